"""The KV cache: block pool and prefix index, per-request block tables, the page-pool tensors, offload, sizing."""
