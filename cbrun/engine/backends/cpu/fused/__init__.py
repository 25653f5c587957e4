"""Whole decoder layers in one call per step, and the attention task plan they run."""
