"""Compute backends: the torch reference and its base (base.py), the CPU and CUDA backends, the selector."""
