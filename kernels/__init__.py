"""LongStraw kernels (imported as `longstraw_kernels`): each op's torch reference beside its GPU versions."""
