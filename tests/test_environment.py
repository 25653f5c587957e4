"""The tests do not see the caller's HF_*, CBRUN_* or scheduler variables (tests/conftest.py removes them).

A pytest run in a subprocess, started with such variables set as a developer's shell might
(HF_HUB_OFFLINE=1 once made a CLI test fail), must find none of them, in its own process or in the
subprocesses it starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CALLERS = {
    "HF_HUB_OFFLINE": "1",
    "HF_ENDPOINT": "http://127.0.0.1:9",
    "TRANSFORMERS_OFFLINE": "1",
    "CBRUN_KERNELS": "torch",
    "CBRUN_NUM_SHARDS": "4",
    "SLURM_ARRAY_TASK_ID": "3",
    "WORLD_SIZE": "8",
}


def test_a_test_run_sees_none_of_the_callers_variables(tmp_path):
    env = {**os.environ, **CALLERS, "CHILD_OUT": str(tmp_path / "seen.txt"), "ENV_CHECK_CHILD": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::test_child"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert (tmp_path / "seen.txt").read_text() == ""


def test_child():
    """Run by the test above in its own pytest process: writes every caller variable it still sees."""
    if os.environ.get("ENV_CHECK_CHILD") != "1":
        pytest.skip("runs only inside test_a_test_run_sees_none_of_the_callers_variables")
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(' '.join(sorted(os.environ)))"], capture_output=True, text=True
    )
    seen = {name for name in CALLERS if name in os.environ or name in child.stdout.split()}
    Path(os.environ["CHILD_OUT"]).write_text(" ".join(sorted(seen)))
