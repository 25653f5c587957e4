"""The CPU backend: compiled C kernels (built per machine), kernel linears, fused decoder layers."""
