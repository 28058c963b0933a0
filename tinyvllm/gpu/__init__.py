"""CUDA backend: PyCUDA kernels (cuda/*.cu), cuBLAS over ctypes, the buffer arena, CUDA graphs.
Importing this package needs PyCUDA; everything else in tinyvllm runs without it."""
