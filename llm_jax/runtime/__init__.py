"""Facts about and set-up of the machine a process runs on (the allocator, the matmul peak, the
platform traced for), and what the command lines share (flag errors, atomic writes, units)."""
