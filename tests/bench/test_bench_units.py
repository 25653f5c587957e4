"""cbrun bench building blocks without a model run: workloads, datasets, count checks, report rendering."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from cbrun.bench.dataset import dataset_workload
from cbrun.bench.report import TABLE_COLUMNS, build_report, fmt, print_report
from cbrun.bench.result import PeerResult, count_check, percentile
from cbrun.bench.runner import output_checks
from cbrun.bench.workload import draw_lengths, random_workload, usable_token_ids, warmup_workload


def test_random_workload_is_seeded_within_length_ranges_and_shares_the_prefix(tiny_tokenizer):
    ids = usable_token_ids(tiny_tokenizer, 512)
    args = dict(num_prompts=50, input_len=40, output_len=20, range_ratio=0.5, prefix_len=16, seed=7)
    a, b = random_workload(ids, **args), random_workload(ids, **args)
    assert a == b
    assert a != random_workload(ids, **{**args, "seed": 8})
    prefix = a.prompts[0][:16]
    assert all(p[:16] == prefix for p in a.prompts)
    assert all(20 <= len(p) - 16 <= 60 for p in a.prompts)
    assert all(10 <= o <= 30 for o in a.output_lens)
    assert len(set(a.output_lens)) > 1
    assert a.max_output_tokens == sum(a.output_lens)


def test_random_prompts_use_only_non_special_ids_inside_both_vocabularies(tiny_tokenizer):
    ids = usable_token_ids(tiny_tokenizer, 512)
    assert ids.max() < min(len(tiny_tokenizer), 512)
    assert not set(ids.tolist()) & set(tiny_tokenizer.all_special_ids)
    work = random_workload(ids, num_prompts=20, input_len=30, output_len=4, seed=0)
    allowed = set(ids.tolist())
    assert all(t in allowed for p in work.prompts for t in p)


def test_lengths_follow_vllm_range_rule():
    rng = np.random.default_rng(0)
    lens = draw_lengths(rng, 272, 0.88, 2000)
    assert min(lens) >= 32 and max(lens) <= 511
    assert draw_lengths(rng, 10, 0.0, 5) == [10] * 5


def test_warmup_requests_differ_from_timed_ones(tiny_tokenizer):
    ids = usable_token_ids(tiny_tokenizer, 512)
    work = random_workload(ids, num_prompts=20, input_len=30, output_len=64, prefix_len=8, seed=0)
    warm = warmup_workload(work, ids)
    assert warm.num_prompts == 8 and max(warm.output_lens) <= 16
    assert not any(p[:8] == work.prompts[0][:8] for p in warm.prompts)


@pytest.mark.parametrize("bad", [dict(num_prompts=0), dict(range_ratio=1.0), dict(prefix_len=-1), dict(n=0)])
def test_bad_workload_values_are_refused(tiny_tokenizer, bad):
    ids = usable_token_ids(tiny_tokenizer, 512)
    args = {**dict(num_prompts=2, input_len=4, output_len=4), **bad}
    with pytest.raises(ValueError):
        random_workload(ids, **args)


def test_dataset_workload_reads_prompt_messages_and_ids_and_skips_bad_rows(tmp_path, tiny_tokenizer):
    rows = [
        {"prompt": "the quick brown fox"},
        {"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 5},
        {"input_ids": [5, 6, 7]},
        {"nothing": 1},
        {"input_ids": [5, 9999]},
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    work, skipped = dataset_workload(path, tiny_tokenizer, output_len=8, max_context=2048, vocab_size=512)
    assert work.num_prompts == 3
    assert work.prompts[0] == tiny_tokenizer("the quick brown fox")["input_ids"]
    assert work.prompts[2] == [5, 6, 7]
    assert work.output_lens == [8, 5, 8]
    assert not work.ignore_eos
    assert len(skipped) == 2 and "row 3" in skipped[0] and "row 4" in skipped[1]
    limited, _ = dataset_workload(path, tiny_tokenizer, output_len=8, max_context=2048, vocab_size=512, num_prompts=2)
    assert limited.num_prompts == 2


def test_distinct_prompt_tokens_count_a_shared_prefix_once(tiny_tokenizer):
    ids = usable_token_ids(tiny_tokenizer, 512)
    work = random_workload(ids, num_prompts=10, input_len=20, output_len=4, prefix_len=16, seed=3)
    distinct_prefixes = {tuple(p[:i]) for p in work.prompts for i in range(1, len(p) + 1)}
    assert work.num_distinct_prompt_tokens == len(distinct_prefixes)
    assert work.num_distinct_prompt_tokens <= work.num_input_tokens - 9 * 16  # the prefix counted once
    no_prefix = random_workload(ids, num_prompts=10, input_len=20, output_len=4, seed=3)
    assert no_prefix.num_distinct_prompt_tokens == no_prefix.num_input_tokens
    from cbrun.bench.workload import Workload

    assert Workload(prompts=[[1, 2, 3], [1, 2, 4], [1, 2, 3]], output_lens=[1, 1, 1]).num_distinct_prompt_tokens == 4


def test_percentile_interpolates():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)


def test_count_check_requires_exact_lengths_under_ignore_eos():
    good = PeerResult("a", output_counts=[4, 4])
    short = PeerResult("b", output_counts=[4, 3])
    assert count_check(good, [4, 4], None) is None
    message = count_check(short, [4, 4], None)
    assert "b:" in message and "first at prompt 1: 3 vs 4" in message
    assert count_check(PeerResult("c", status="unavailable"), [4, 4], None) is None


def _fake_results():
    cbrun = PeerResult(
        "cbrun", wall_s=2.0, num_requests=4, num_input_tokens=100, output_counts=[8] * 4, ttfts=[0.1, 0.2, 0.3, 0.4]
    )
    cbrun.details["stats"] = {
        "steps": 10,
        "mean_decode_batch": 3.5,
        "peak_kv_occupancy": 0.25,
        "prefix_hit_rate": 0.5,
        "offloads": 0,
        "soft_resets": 1,
    }
    static = PeerResult("hf-static", wall_s=4.0, num_requests=4, num_input_tokens=100, output_counts=[8, 8, 8, 7])
    vllm = PeerResult("vllm", status="unavailable", reason="not installed")
    return [cbrun, static, vllm]


def test_report_table_lines_and_json_show_the_same_figures():
    results = _fake_results()
    ceiling = {
        "gflop_per_token": 0.269,
        "gemm_rows": 256,
        "reference_dtype": "bfloat16",
        "gemm_gflops": {"bfloat16": {"best": 500.0}, "float32": {"best": 150.0}},
    }
    config = {"ignore_eos": True, "dtype_resolved": "float32"}
    checks = output_checks(results, type("W", (), {"n": 1, "output_lens": [8] * 4, "ignore_eos": True})())
    report = build_report(config, {"device": "cpu"}, results, ceiling, checks, "float32")
    out = io.StringIO()
    print_report(report, file=out)
    text = out.getvalue()
    json.loads(json.dumps(report, default=str))  # serializable

    cbrun, static, vllm = report["results"]
    assert cbrun["ratio_to_cbrun"] == 1.0 and static["ratio_to_cbrun"] == pytest.approx(31 / 4 / (32 / 2))
    assert static["output_count_check"] != "ok" and "MISMATCH" in text
    assert vllm["status"] == "unavailable" and "vllm: unavailable: not installed" in text
    assert cbrun["compute_ceiling_fraction"] == pytest.approx((132 / 2.0) * 0.269 / 500.0)
    # with shared prefixes, only the tokens left to compute count toward the ceiling
    shared = build_report(config, {"device": "cpu"}, results, ceiling, checks, "float32", computed_input_tokens=40)
    assert shared["results"][0]["compute_ceiling_fraction"] == pytest.approx((72 / 2.0) * 0.269 / 500.0)
    assert shared["results"][0]["compute_ceiling_fraction_run_dtype"] == pytest.approx((72 / 2.0) * 0.269 / 150.0)
    for entry in (cbrun, static):
        row = next(line for line in text.splitlines() if line.startswith(f"│ {entry['engine']} "))
        dtype, *cells = [c.strip() for c in row.strip("│").split("│")][1:]
        assert dtype == entry["dtype"] == "float32"  # no engine said otherwise: the run's dtype
        for (_, key, digits), cell in zip(TABLE_COLUMNS, cells):
            assert cell.split()[0] == fmt(entry[key], digits), key
        assert (
            f"Throughput: {fmt(entry['requests_per_s'])} requests/s, {fmt(entry['total_tokens_per_s'])} total "
            f"tokens/s, {fmt(entry['output_tokens_per_s'])} output tokens/s ({entry['engine']})"
        ) in text
    assert "prefix hit rate 50.0%" in text and "soft resets 1" in text
    assert report["cbrun_stats"]["prefix_hit_rate"] == 0.5


def test_vllm_computes_on_the_requested_cores_unless_the_user_bound_them(monkeypatch):
    from cbrun.bench.peers.vllm_peer import vllm_environment

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    assert vllm_environment("cpu")["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"
    assert vllm_environment("cpu", threads=1)["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in vllm_environment("cuda")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")
    assert vllm_environment("cpu", threads=2)["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert vllm_environment("cpu")["HF_HUB_OFFLINE"] == "1"
