"""The C library's entry points as Python calls: loading it, its ABI, one wrapper per kernel family."""
