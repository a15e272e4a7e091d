"""Running on many devices: the mesh and logical-axis rules, multi-host start-up, AOT compiling."""
