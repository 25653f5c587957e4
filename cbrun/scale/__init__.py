"""Past one machine: deterministic shards (`shards`) and Ray Data (`ray_data`), with no coordinator of our own."""
