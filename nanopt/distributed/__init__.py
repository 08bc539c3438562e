"""The device and the ranks: the runtime, DDP / FSDP2, XLA, the memory estimate, peaks."""
