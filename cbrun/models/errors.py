"""The one error every way of loading a model raises, so that callers catch a single type."""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """The spec could not be turned into a model the engine can drive; the message says why."""
