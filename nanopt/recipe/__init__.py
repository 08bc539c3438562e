"""The recipe: the model, its attention kernels, the optimizers, FLOPs and MFU, FP8."""
