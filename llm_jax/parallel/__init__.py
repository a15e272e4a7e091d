"""Running on many devices: the mesh and logical-axis rules, multi-host start-up, a compiled
step's roofline."""
