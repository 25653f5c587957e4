"""`cbrun bench`: synthetic and dataset workloads, peer engines, and the throughput report.

Layering: the CLI builds a Workload and a PeerContext, `runner.run_bench`
runs each peer (cbrun through the Engine's public API only) and returns a
report dict that `report` prints and saves.
"""
