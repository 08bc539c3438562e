"""Training: the stage plan, the data loaders, the loop, checkpoints, metrics, the profiler."""
