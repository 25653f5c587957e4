"""Linear methods: packed weight layouts, the load-time self-check, and choosing one per shape."""
