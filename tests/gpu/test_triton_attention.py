"""The Triton paged-attention kernel computes what the torch reference computes, reading pages in place.

How the kernel runs here. With CUDA, the kernel tests (`test_kernel_*`) run the compiled kernel on the GPU.
Without it they run under Triton's CPU interpreter on CPU tensors, which in triton 3.9 must be switched on
before triton is first imported in the process: `TRITON_INTERPRET` is read when a function is decorated
with `@triton.jit`, and triton.language's own jitted helpers (tl.max, tl.sum, ...) are decorated at
triton's import. Setting the variable at the top of this module is not enough in the full suite: test
modules collected earlier import transformers models, and torch imports triton for them. So:
- TRITON_INTERPRET=1 already in the environment (set before the process started): run in-process;
- otherwise, on CPU: the kernel tests are skipped here and `test_interpreter_subprocess` reruns them in
  a fresh `python -m pytest` child with TRITON_INTERPRET=1 set from its start (one child, a few seconds
  of startup), which is robust to whatever this process imported first and leaks no variable into it.
Kernel tests are skipped when triton is not installed; the import test runs regardless.

Every pool slot a sequence does not own is NaN (unused blocks, the padded table entries, positions
before its lowest kv_lo and past its highest kv_len), so any read outside a row's range shows.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from cbrun.engine.backends.cuda.triton_attention import (
    default_block_rows,
    paged_attention,
    plan_query_blocks,
    reference_paged_attention,
)
from cbrun.engine.backends.metadata import PagedRows

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")  # set at process start
IN_PROCESS = torch.cuda.is_available() or INTERPRETED
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (the CPU engine does not need it)")
kernel_test = pytest.mark.skipif(
    not (HAS_TRITON and IN_PROCESS),
    reason=(
        "triton is not installed"
        if not HAS_TRITON
        else "no CUDA and TRITON_INTERPRET unset at start: "
        "test_interpreter_subprocess runs this in a child process under the interpreter"
    ),
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


@dataclass
class Seq:
    """One sequence's rows: query positions start .. start + rows - 1; window keeps the last `window` keys."""

    start: int
    rows: int = 1
    window: int | None = None


@dataclass
class Case:
    q: torch.Tensor  # [R, H, D]
    k_pool: torch.Tensor  # viewed [H_kv, NB, page, D]
    v_pool: torch.Tensor
    tables: torch.Tensor  # [S, max_pages]
    row_seq: torch.Tensor  # [R]
    first_page: torch.Tensor  # [S]
    kv_len: torch.Tensor  # [R]
    kv_lo: torch.Tensor  # [R]
    scale: float

    def args(self) -> tuple:
        paged = PagedRows(self.tables, self.row_seq, self.first_page, self.kv_len, self.kv_lo)
        return (self.q, self.k_pool, self.v_pool, paged, self.scale)


def make_case(
    seqs: list[Seq],
    kv_heads: int = 2,
    group: int = 2,
    dim: int = 64,
    page: int = 16,
    dtype: torch.dtype = torch.float32,
    flash_layout: bool = False,
    table_dtype: torch.dtype = torch.int32,
    seed: int = 0,
) -> Case:
    """Random q and pools with shuffled, padded block tables; slots no row may read are NaN."""
    gen = torch.Generator().manual_seed(seed)
    kv_len = [p + 1 for s in seqs for p in range(s.start, s.start + s.rows)]
    kv_lo = [max(0, p + 1 - s.window) if s.window else 0 for s in seqs for p in range(s.start, s.start + s.rows)]
    row_seq = [i for i, s in enumerate(seqs) for _ in range(s.rows)]
    lo_of = [min(lo for lo, r in zip(kv_lo, row_seq) if r == i) for i in range(len(seqs))]  # seq's lowest key
    hi_of = [max(n for n, r in zip(kv_len, row_seq) if r == i) for i in range(len(seqs))]
    first_page = [lo // page for lo in lo_of]
    num_pages = [(hi - 1) // page + 1 - f for hi, f in zip(hi_of, first_page)]
    max_pages, num_blocks = max(num_pages) + 1, sum(num_pages) + 3  # a padded column; spare NaN blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    spare = torch.randint(0, 3, (len(seqs), max_pages), generator=gen)
    tables = torch.tensor(order[:3], dtype=table_dtype)[spare]  # [S, max_pages], padding points at NaN blocks
    shape = (num_blocks, page, kv_heads, dim) if flash_layout else (kv_heads, num_blocks, page, dim)
    pools = [torch.full(shape, float("nan"), dtype=dtype) for _ in range(2)]
    views = [p.permute(2, 0, 1, 3) if flash_layout else p for p in pools]  # [H_kv, NB, page, D]
    used = 3
    for i, n in enumerate(num_pages):
        tables[i, :n] = torch.tensor(order[used : used + n], dtype=table_dtype)
        used += n
        for pos in range(lo_of[i], hi_of[i]):
            block, slot = int(tables[i, pos // page - first_page[i]]), pos % page
            for view in views:
                view[:, block, slot] = torch.randn(kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(len(kv_len), kv_heads * group, dim, generator=gen).to(dtype)
    as_long = lambda values: torch.tensor(values, dtype=torch.int64, device=DEVICE)  # noqa: E731
    return Case(
        q.to(DEVICE),
        views[0].to(DEVICE),
        views[1].to(DEVICE),
        tables.to(DEVICE),
        as_long(row_seq),
        as_long(first_page),
        as_long(kv_len),
        as_long(kv_lo),
        dim**-0.5,
    )


def check(case: Case, **kwargs) -> torch.Tensor:
    """Run the kernel, compare with the reference, return the kernel's output."""
    out = paged_attention(*case.args(), **kwargs)
    ref = reference_paged_attention(*case.args())
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert torch.isfinite(out.float()).all()
    tol = TOLERANCE[case.q.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    return out


def test_plan_query_blocks():
    blocks = plan_query_blocks([0, 1, 1, 1, 1, 1, 2, 2, 3], 2)
    assert blocks.dtype == torch.int32
    assert blocks.tolist() == [[0, 1], [1, 2], [3, 2], [5, 1], [6, 2], [8, 1]]
    assert plan_query_blocks(torch.tensor([4, 4, 4]), 8).tolist() == [[0, 3]]
    assert plan_query_blocks([], 4).shape == (0, 2)
    assert default_block_rows(1) == 64 and default_block_rows(3) == 21 and default_block_rows(128) == 1


@kernel_test
def test_kernel_decode_rows_over_shuffled_pages():
    """One row per sequence, lengths from 1 key to several pages; q a non-contiguous view."""
    case = make_case([Seq(0), Seq(16), Seq(39), Seq(63), Seq(100)])
    case.q = case.q.transpose(0, 1).contiguous().transpose(0, 1)  # [R, H, D] with strides of [H, R, D]
    check(case)


@kernel_test
def test_kernel_prefill_chunk_over_cached_prefix():
    """Rows 21..50 of one sequence (the chunk starts mid-page); small blocks so several programs share it."""
    case = make_case([Seq(21, rows=30)])
    out = check(case)
    torch.testing.assert_close(
        check(case, query_blocks=plan_query_blocks(case.row_seq.cpu(), 4), block_rows=4), out, atol=1e-6, rtol=1e-6
    )


@kernel_test
def test_kernel_fresh_prefill():
    case = make_case([Seq(0, rows=40)], page=8)
    check(case)


@kernel_test
@pytest.mark.parametrize("group", [1, 3, 4])
def test_kernel_gqa_groups(group):
    case = make_case([Seq(5), Seq(30, rows=9), Seq(0, rows=3)], kv_heads=2, group=group)
    check(case)


@kernel_test
def test_kernel_sliding_window_drops_first_pages():
    """kv_lo > 0 and first_page > 0: a decode and a chunk whose window starts past several pages."""
    case = make_case([Seq(70, window=20), Seq(45, rows=12, window=20), Seq(3, window=20)])
    assert (case.first_page > 0).sum() == 2 and (case.kv_lo > 0).any()
    check(case)


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_mixed_batch_dtypes(dtype):
    """Decodes first, then chunks (one over a cached prefix, one fresh), as the engine lays a step out."""
    case = make_case([Seq(12), Seq(47), Seq(33, rows=10), Seq(0, rows=7)], group=3, dtype=dtype)
    check(case)


@kernel_test
@pytest.mark.parametrize("page", [8, 24])
def test_kernel_page_sizes(page):
    case = make_case([Seq(50), Seq(17, rows=13)], page=page)
    check(case)


@kernel_test
def test_kernel_flash_pool_layout():
    """A [NB, page, H_kv, D] pool passed as its permuted [H_kv, NB, page, D] view; int64 tables."""
    case = make_case([Seq(40), Seq(9, rows=11, window=8)], flash_layout=True, table_dtype=torch.int64)
    assert not case.k_pool.is_contiguous()
    check(case)


@kernel_test
@pytest.mark.parametrize("dim", [80, 96, 128])
def test_kernel_head_dims(dim):
    case = make_case([Seq(25), Seq(6, rows=5)], dim=dim, group=1)
    check(case)


@kernel_test
def test_kernel_blocks_longer_than_the_tile():
    """A plan with more rows per block than the kernel's M tile holds is walked in pieces."""
    case = make_case([Seq(3), Seq(10, rows=20)], group=4)
    blocks = plan_query_blocks(case.row_seq.cpu(), 64)
    check(case, query_blocks=blocks, block_rows=2)


@kernel_test
def test_kernel_row_without_keys_is_zero():
    case = make_case([Seq(20), Seq(30)])
    case.kv_lo[1] = case.kv_len[1]
    out = check(case)
    assert torch.equal(out[1].cpu(), torch.zeros_like(out[1].cpu()))


@pytest.mark.slow  # heavy (a subprocess, a build, a cluster or signals): the full suite only
@needs_triton
@pytest.mark.skipif(IN_PROCESS, reason="the kernel tests run in this process")
def test_interpreter_subprocess():
    """Run this module's kernel tests in a fresh process with TRITON_INTERPRET=1 set before triton loads."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "test_kernel_", str(Path(__file__))]
    result = subprocess.run(cmd, cwd=root, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " skipped" not in result.stdout, result.stdout[-2000:]


@pytest.mark.slow  # heavy (a subprocess, a build, a cluster or signals): the full suite only
def test_imports_without_triton():
    """The CPU engine may import this module where triton is absent: import works, the kernel says why not."""
    script = """
import sys
class NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("triton blocked for this test")
sys.meta_path.insert(0, NoTriton())
import torch
from cbrun.engine.backends.cuda import triton_attention as ta
assert not ta.triton_available()
q = torch.zeros(1, 1, 16)
pool = torch.zeros(1, 1, 4, 16)
from cbrun.engine.backends.metadata import PagedRows
paged = PagedRows(torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.long),
                  torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
args = (q, pool, pool, paged, 1.0)
assert ta.reference_paged_attention(*args).shape == (1, 1, 16)
try:
    ta.paged_attention(*args)
except RuntimeError as e:
    assert "triton" in str(e)
else:
    raise AssertionError("paged_attention ran without triton")
"""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
