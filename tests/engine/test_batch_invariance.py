"""Batch invariance: a request's tokens and logprobs are the same bits whatever else shares its steps.

Kernel level: a linear row alone and among hundreds; a query attended as a
decode row, as a token inside a prefill chunk, and as one of a group sharing a
prefix. Engine level: a seeded request with logprobs alone against the same
request among others under other token budgets, request limits, prefill chunk
boundaries, prefix-cache hits and preemption (soft reset and offload), in fp32
and bf16, on tiny models and the real one.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import random_prompts, run_requests

from cbrun.engine import Engine, EngineConfig, SamplingParams
from cbrun.engine.backends.cpu.fused.attention_tasks import SequenceRows, plan_tasks
from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels
from cbrun.engine.backends.metadata import PagedRows
from cbrun.models import load_model

kernels = load_cpu_kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="compiled CPU kernels unavailable (no C compiler)")
DTYPES = [torch.float32, torch.bfloat16]


# -- kernels ------------------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inner", [64, 100, 576])
def test_linear_row_is_the_same_alone_and_in_any_crowd(dtype, inner):
    gen = torch.Generator().manual_seed(inner)
    weight = torch.randn(70, inner, generator=gen).to(dtype)
    bias = torch.randn(70, generator=gen).to(dtype)
    crowd = torch.randn(700, inner, generator=gen).to(dtype)
    everyone = kernels.linear(crowd, weight, bias)  # [700, 70]
    for first, count in [(0, 1), (5, 1), (3, 7), (0, 8), (9, 9), (0, 16), (17, 31), (100, 257), (0, 700)]:
        got = kernels.linear(crowd[first : first + count], weight, bias)
        assert torch.equal(got, everyone[first : first + count]), (first, count)
    reference = torch.nn.functional.linear(crowd.float(), weight.float(), bias.float())
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(everyone.float(), reference, atol=tolerance * reference.abs().max(), rtol=0)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_and_multi_weight_linears_are_row_invariant(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(300, 48, generator=gen).to(dtype)
    gate, up = (torch.randn(40, 48, generator=gen).to(dtype) for _ in range(2))
    q, k = torch.randn(32, 48, generator=gen).to(dtype), torch.randn(16, 48, generator=gen).to(dtype)
    gated, both = kernels.gated_silu(x, gate, up), kernels.linear_many(x, [q, k], [None, None])
    for rows in (slice(0, 1), slice(7, 12), slice(16, 33), slice(299, 300)):
        assert torch.equal(kernels.gated_silu(x[rows], gate, up), gated[rows])
        assert torch.equal(kernels.linear_many(x[rows], [q, k], [None, None]), both[rows])


@needs_kernels
def test_linear_refuses_what_it_cannot_compute():
    from cbrun.engine.backends.cpu.kernels.abi import KernelError

    x = torch.randn(3, 8)
    with pytest.raises(KernelError, match="weights in one call"):
        kernels.linear_many(x, [torch.randn(4, 8)] * (kernels.max_segments + 1), [None] * (kernels.max_segments + 1))
    with pytest.raises(KernelError, match="does not fit"):
        kernels.linear(x, torch.randn(4, 9))
    with pytest.raises(KernelError, match="dtypes"):
        kernels.linear(x.double(), torch.randn(4, 8).double())


def _pools(dtype, num_kv=2, blocks=40, page=16, dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(num_kv, blocks, page, dim, generator=gen).to(dtype),
        torch.randn(num_kv, blocks, page, dim, generator=gen).to(dtype),
    )


def _attend(q, k_pool, v_pool, seqs: list[SequenceRows], lengths, scale=0.25, windowed=False, window=None):
    """Run the kernel for rows described by `seqs` (each token a row), tasks planned as the engine does."""
    page = k_pool.shape[2]
    max_pages = max(len(s.table) for s in seqs)
    tables = torch.tensor([s.table + [s.table[0]] * (max_pages - len(s.table)) for s in seqs])
    row_seq = torch.tensor([i for i, s in enumerate(seqs) for _ in range(s.count)])
    kv_len = torch.tensor(lengths)
    kv_lo = (kv_len - window).clamp(min=0) if window else torch.zeros_like(kv_len)
    first = torch.tensor([s.first_page for s in seqs])
    tasks = plan_tasks(seqs, page, kernels.segment, windowed)
    return kernels.attend(q, k_pool, v_pool, PagedRows(tables, row_seq, first, kv_len, kv_lo), tasks, scale), tasks


def _reference(q_row, k_pool, v_pool, table, length, scale, lo=0):
    """Plain softmax attention of one query [H, D] over keys [lo, length) of the table's pages."""
    num_kv, _, _page, dim = k_pool.shape
    keys = k_pool[:, table].reshape(num_kv, -1, dim)[:, lo:length].float()  # [H_kv, L, D]
    values = v_pool[:, table].reshape(num_kv, -1, dim)[:, lo:length].float()
    group = q_row.shape[0] // num_kv
    q = q_row.float().view(num_kv, group, dim)
    probs = torch.softmax(q @ keys.transpose(1, 2) * scale, dim=-1)  # [H_kv, G, L]
    return (probs @ values).reshape(-1, dim)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_query_gets_the_same_bits_as_decode_chunk_token_and_shared_prefix_row(dtype):
    k_pool, v_pool = _pools(dtype)
    heads, dim = 4, 16
    table = list(range(3, 3 + 12))  # 12 pages of 16: up to 192 keys
    gen = torch.Generator().manual_seed(5)
    q_chunk = torch.randn(150, heads, dim, generator=gen).to(dtype)  # queries at positions 0..149
    # (a) the whole prompt as one fresh chunk
    chunk, _ = _attend(q_chunk, k_pool, v_pool, [SequenceRows(0, 0, 150, table, 0)], list(range(1, 151)))
    # (b) the same tokens in two chunks, the second over the first's cached keys (a shared task)
    second, tasks = _attend(q_chunk[130:], k_pool, v_pool, [SequenceRows(0, 130, 20, table, 0)], list(range(131, 151)))
    assert int(tasks[2].max()) == kernels.segment  # the cached context was attended as a shared task
    assert torch.equal(second, chunk[130:])
    # (c) each token as a decode row, alone
    for pos in (0, 15, 63, 64, 100, 127, 128, 149):
        alone, _ = _attend(
            q_chunk[pos : pos + 1].contiguous(), k_pool, v_pool, [SequenceRows(0, pos, 1, table, 0)], [pos + 1]
        )
        assert torch.equal(alone, chunk[pos : pos + 1]), pos
    # (d) decode rows of 20 sequences sharing the first 8 pages (cascade), row 0 is position 149 of `table`
    others = [SequenceRows(i, 140 + i % 5, 1, table[:8] + list(range(15 + i, 19 + i)), 0) for i in range(1, 20)]
    seqs = [SequenceRows(0, 149, 1, table, 0)] + others
    q_rows = torch.cat([q_chunk[149:150], torch.randn(19, heads, dim, generator=gen).to(dtype)])
    crowd, tasks = _attend(q_rows, k_pool, v_pool, seqs, [s.start + 1 for s in seqs])
    assert int(tasks[2].max()) == 128  # 8 shared pages = one whole segment
    assert torch.equal(crowd[0], chunk[149])
    reference = _reference(q_chunk[149], k_pool, v_pool, table, 150, 0.25)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(chunk[149].float(), reference, atol=tolerance)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_large_shared_task_gives_each_row_its_bits_alone(dtype):
    """A task with more rows than the kernel takes through a shared segment at once (16 query heads per
    kv head: 3 rows a pass) gives every row the bits it gets alone, the last partial pass included."""
    k_pool, v_pool = _pools(dtype, num_kv=1, blocks=60, seed=7)
    heads, dim, count = 16, 16, 11
    shared_pages = list(range(16))  # 256 keys: two whole segments
    seqs = [SequenceRows(i, 256 + 3 * i, 1, shared_pages + [16 + 2 * i, 17 + 2 * i], 0) for i in range(count)]
    lengths = [s.start + 1 for s in seqs]
    q = torch.randn(count, heads, dim, generator=torch.Generator().manual_seed(8)).to(dtype)
    page = k_pool.shape[2]
    tables = torch.tensor([s.table for s in seqs])
    args = (
        tables,
        torch.arange(count),
        torch.zeros(count, dtype=torch.long),
        torch.tensor(lengths),
        torch.zeros(count, dtype=torch.long),
    )
    one_task = plan_tasks(seqs, page, kernels.segment, False, max_rows=count)
    assert one_task[1].tolist() == [0, count] and int(one_task[2][0]) == 256
    crowd = kernels.attend(q, k_pool, v_pool, PagedRows(*args), one_task, 0.25)
    for i, seq in enumerate(seqs):
        alone, _ = _attend(
            q[i : i + 1].contiguous(), k_pool, v_pool, [SequenceRows(0, seq.start, 1, seq.table, 0)], [lengths[i]]
        )
        assert torch.equal(alone[0], crowd[i]), i
        reference = _reference(q[i], k_pool, v_pool, seq.table, lengths[i], 0.25)
        assert torch.allclose(crowd[i].float(), reference, atol=1e-5 if dtype == torch.float32 else 2e-2)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_sliding_window_rows_are_the_same_in_a_chunk_and_alone(dtype):
    k_pool, v_pool = _pools(dtype, seed=3)
    table = list(range(10))
    q = torch.randn(100, 4, 16, generator=torch.Generator().manual_seed(2)).to(dtype)
    window = 40
    chunk, _ = _attend(
        q, k_pool, v_pool, [SequenceRows(0, 0, 100, table, 0)], list(range(1, 101)), windowed=True, window=window
    )
    for pos in (0, 39, 40, 77, 99):
        alone, _ = _attend(
            q[pos : pos + 1].contiguous(),
            k_pool,
            v_pool,
            [SequenceRows(0, pos, 1, table, 0)],
            [pos + 1],
            windowed=True,
            window=window,
        )
        assert torch.equal(alone, chunk[pos : pos + 1])
        reference = _reference(q[pos], k_pool, v_pool, table, pos + 1, 0.25, lo=max(0, pos + 1 - window))
        assert torch.allclose(chunk[pos].float(), reference, atol=1e-5 if dtype == torch.float32 else 2e-2)


@needs_kernels
def test_attend_refuses_inconsistent_tasks():
    from cbrun.engine.backends.cpu.kernels.abi import KernelError

    k_pool, v_pool = _pools(torch.float32)
    q = torch.randn(2, 4, 16)
    tables = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 9, 9, 9]])
    args = (tables, torch.tensor([0, 1]), torch.tensor([0, 0]), torch.tensor([70, 70]), torch.tensor([0, 0]))
    shared = (torch.tensor([0, 1]), torch.tensor([0, 2]), torch.tensor([64]))  # pages 2-3 differ: only 32 shared
    with pytest.raises(KernelError):
        kernels.attend(q, k_pool, v_pool, PagedRows(*args), shared, 0.25)
    beyond = (tables, torch.tensor([0, 1]), torch.tensor([0, 0]), torch.tensor([70, 90]), torch.tensor([0, 0]))
    alone = (torch.tensor([0, 1]), torch.tensor([0, 1, 2]), torch.tensor([0, 0]))
    with pytest.raises(KernelError):  # row 1 reads past its table's block ids (block 9 of 40 is fine, 90 keys not)
        kernels.attend(q, k_pool, v_pool, PagedRows(*beyond[:3], torch.tensor([70, 81]), beyond[4]), alone, 0.25)


# -- engine -------------------------------------------------------------------------------------------


def _target_and_crowd(vocab):
    target = random_prompts(vocab, [90], seed=11)[0]
    crowd_prompts = random_prompts(vocab, [5 + 13 * i % 120 for i in range(25)], seed=12)
    crowd_prompts[3] = target[:60] + crowd_prompts[3]  # shares the target's first pages
    return target, crowd_prompts


def _crowd_requests(target, crowd_prompts, sampling):
    crowd = [
        (f"c{i}", p, SamplingParams(max_tokens=12 + i % 9, temperature=0.8, seed=i))
        for i, p in enumerate(crowd_prompts)
    ]
    return crowd[:10] + [("t", target, sampling)] + crowd[10:]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_seeded_request_alone_and_in_a_crowd_is_bitwise_identical(request, fixture, dtype):
    model, tokenizer = load_model(str(request.getfixturevalue(fixture)), dtype=dtype)
    target, crowd_prompts = _target_and_crowd(model.config.vocab_size)
    sampling = SamplingParams(max_tokens=24, temperature=1.0, seed=7, n=3)
    alone = run_requests(model, tokenizer, [("t", target, sampling)], EngineConfig(max_batch_tokens=512, num_blocks=64))
    configs = [
        (EngineConfig(max_batch_tokens=64, num_blocks=256), None),  # chunked prefill, crowded steps
        (EngineConfig(max_batch_tokens=37, max_requests_per_batch=5, num_blocks=256, scheduler="prefill-first"), None),
        (EngineConfig(max_batch_tokens=96, num_blocks=12, cpu_offload_space=0), "soft_resets"),
        (EngineConfig(max_batch_tokens=96, num_blocks=12, cpu_offload_space=0.0001), "offloads"),
    ]
    for config, preempts in configs:
        crowded = run_requests(model, tokenizer, _crowd_requests(target, crowd_prompts, sampling), config, preempts)
        assert crowded["t"] == alone["t"], config
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    first = run_requests(model, tokenizer, [("a", target, greedy)], EngineConfig(max_batch_tokens=512, num_blocks=64))
    with Engine(model, tokenizer, EngineConfig(max_batch_tokens=48, num_blocks=64)) as engine:  # prefix hit
        engine.add_request(target[:80], SamplingParams(max_tokens=1), request_id="warm")
        engine.get_result(timeout=600)
        engine.add_request(target, greedy, request_id="a")
        hit = engine.get_result(timeout=600)
    assert hit.num_cached_tokens > 0
    assert (list(hit.token_ids), list(hit.logprobs)) == first["a"][0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_real_model_request_is_bitwise_identical_alone_and_in_a_crowd(smollm2_loader, dtype):
    model, tokenizer = smollm2_loader(dtype)
    target, crowd_prompts = _target_and_crowd(model.config.vocab_size)
    sampling = SamplingParams(max_tokens=12, temperature=1.0, seed=3, n=2)
    alone = run_requests(model, tokenizer, [("t", target, sampling)], EngineConfig(max_batch_tokens=512, num_blocks=64))
    crowded = run_requests(
        model,
        tokenizer,
        _crowd_requests(target, crowd_prompts[:12], sampling),
        EngineConfig(max_batch_tokens=64, num_blocks=256),
    )
    assert crowded["t"] == alone["t"]


# -- the command line: shards, windows and resume give the same rows -----------------------------------


def test_generate_rows_are_bitwise_the_same_across_shards_windows_and_resume(tiny_llama_dir, tmp_path):
    import json

    from cbrun.cli.app import main

    prompts = random_prompts(500, [3 + 7 * i % 40 for i in range(24)], seed=4)
    rows = [{"id": f"r{i}", "input_ids": p} for i, p in enumerate(prompts)]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = [
        "-m",
        str(tiny_llama_dir),
        "--max-tokens",
        "10",
        "--temperature",
        "0.9",
        "--seed",
        "5",
        "--n",
        "2",
        "--logprobs",
        "--num-blocks",
        "256",
        "-q",
    ]

    def generate(out, *extra, written=None):
        assert main(["generate", str(source), str(out), *common, *extra]) == 0
        return {
            (r["id"], r["sample"]): (r["completion_token_ids"], r["logprobs"])
            for r in map(json.loads, (written or out).read_text().splitlines())
        }

    whole = generate(tmp_path / "whole.jsonl", "--max-batch-tokens", "512")
    narrow = generate(tmp_path / "narrow.jsonl", "--window", "3", "--max-batch-tokens", "40")
    assert narrow == whole
    sharded = {}
    for index in range(3):
        sharded.update(
            generate(
                tmp_path / "shard-{shard}.jsonl",
                "--num-shards",
                "3",
                "--shard-index",
                str(index),
                written=tmp_path / f"shard-{index}.jsonl",
            )
        )
    assert sharded == whole
    partial = tmp_path / "partial.jsonl"
    partial.write_text("".join((tmp_path / "narrow.jsonl").read_text().splitlines(keepends=True)[:17]))
    assert generate(partial, "--resume", "--max-batch-tokens", "64") == whole  # a kill left 17 rows behind
