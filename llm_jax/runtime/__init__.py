"""Facts about and set-up of the machine a process runs on: the allocator, the matmul peak."""
