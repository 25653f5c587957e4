"""The `--ray` driver holds counters, not rows (issue 35): its peak RSS at two input sizes, ten times apart.

The driver runs in a child process (`scripts/ray_scale.py drive`) with the fake engine, so the job is
cbrun's and Ray's own work: planning, reading, parts, manifests, the end-of-job checks. Before issue 35
the driver took about 0.9 KB a row (563 MB at 5,000 rows, 603 MB at 50,000); a driver that held rows
would grow by about 80 MB between these two sizes, three times the bound.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
from cli_helpers import REPO

pytest.importorskip("ray.data", reason="Ray Data is not installed (pip install 'cbrun[ray]')")


def ray_scale():
    spec = importlib.util.spec_from_file_location("ray_scale", REPO / "scripts" / "ray_scale.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ray_scale"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # two Ray jobs of 10k and 100k rows, in child processes
def test_the_driver_peak_memory_does_not_grow_with_the_input(tmp_path):
    scale = ray_scale()
    peaks = {}
    for rows in (10_000, 100_000):
        source = scale.make_input(rows, tmp_path)
        result = scale.run_driver(
            ["--input", str(source), "--output", str(tmp_path / f"out-{rows}.parquet"), "--replicas", "2"]
        )
        assert result is not None and result["rows"] == rows and result["missing"] == result["doubled"] == 0
        peaks[rows] = result["peak_rss_mb"]
    assert peaks[100_000] - peaks[10_000] < 25, peaks  # 90,000 more rows: under 290 bytes a row
