"""Optional compatibility shims for running third-party frameworks (megatron-core) on the CPU."""
