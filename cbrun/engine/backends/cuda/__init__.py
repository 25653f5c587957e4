"""CUDA-only engine pieces (Triton kernels); importing them never requires triton or a GPU."""
