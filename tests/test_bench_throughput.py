"""bench/throughput.py beyond tests/test_bench.py's smoke runs: the setups and prompts, which systems run by default,
one worker's measurement on a tiny model, the report's arithmetic (tok/s, speed-ups, same tokens, the matmul limit)
from stand-in worker results, a failed system, and the few-row linear table it prints."""
import json
from types import SimpleNamespace

import pytest

import hf_paged
from hf_paged.bench import throughput, throughput_report
from hf_paged.trials import SAMPLES

TINY = dict(model=dict(vocab_size=300, hidden=32, layers=1, heads=2, kv_heads=1, max_len=512, intermediate_size=64),
            prompt_len=(4, 12), requests=[3], max_tokens=4)


def test_prompts():
    prompts = throughput.make_prompts(40, 50, 2, 6)
    assert prompts == throughput.make_prompts(40, 50, 2, 6) and prompts != throughput.make_prompts(40, 50, 2, 6, 1)
    assert all(2 <= len(p) <= 6 and all(3 <= t < 50 for t in p) for p in prompts)


@pytest.mark.parametrize("argv, systems, requests, max_tokens", [
    (["--small"], ["hf_paged", "hf_padded", "hf_generate_batch_sized"], [4, 8], 8),
    ([], ["hf_paged", "hf_padded", "hf_generate_batch"], [16, 64], 64),
    (["--arch", "qwen3_5_text", "--small"], ["hf_paged", "hf_padded"], [4, 8], 8),
    (["--arch", "gpt_oss"], ["hf_paged", "hf_padded"], [16, 64], 64),
    (["--systems", "hf_padded", "--requests", "5", "--max-tokens", "2"], ["hf_padded"], [5], 2),
])
def test_defaults(monkeypatch, argv, systems, requests, max_tokens):
    seen = []
    monkeypatch.setattr(throughput, "worker", lambda args, setup: seen.append(args))
    assert throughput.main([*argv, "--worker", "matmul"]) == 0
    (args,) = seen
    assert args.systems == systems and args.requests == requests and args.max_tokens == max_tokens


def test_measure_on_a_tiny_model(restore):
    args = SimpleNamespace(arch="llama", dtype="float32", max_tokens=4)
    paged = throughput.measure("hf_paged", 3, args, TINY, 1)
    padded = throughput.measure("hf_padded", 3, args, TINY, 1)
    for r in (paged, padded):
        assert r["requests"] == 3 and r["output_tokens"] == 12 and [len(t) for t in r["tokens"]] == [4] * 3
        assert r["seconds"] > 0 and r["peak_rss_mb"] > 0 and r["threads"] == 1
        p = r["params"]
        assert p["embedding"] == p["lm_head"] == 300 * 32
        assert p["non_embedding"] == p["total"] - p["embedding"] - p["lm_head"] > 0
    assert paged["tokens"] == padded["tokens"]
    assert "small_linears" in paged and "small_linears" not in padded
    assert set(paged["small_linears"]) == {"status", "choices"}
    assert set(paged["fused"]) == {"norms", "norms_status", "rotary", "rotary_status"} and "fused" not in padded
    assert isinstance(paged["fused"]["norms_status"], str) and 0 <= paged["fused"]["norms"] <= 3  # 1 layer x 2 + 1
    assert isinstance(paged["decode_attention"], list) and "decode_attention" not in padded
    assert isinstance(paged["prefill_attention"], list) and "prefill_attention" not in padded
    assert isinstance(paged["expert_products"], list) and "expert_products" not in padded


def test_the_decode_attention_choice_is_printed(capsys):
    r = {"requests": 64, "fused": {"norms": 17, "norms_status": "loaded", "rotary": 8, "rotary_status": "loaded"},
         "decode_attention": [{"dtype": "float32", "heads": 8, "kv_heads": 2, "head_dim": 64, "block_size": 16,
                               "threads": 1, "path": "keys", "source": "measured",
                               "us": {"torch": 8000.0, "keys": 600.0, "vector": 630.0}}],
         "prefill_attention": [{"dtype": "float32", "heads": 8, "kv_heads": 2, "head_dim": 64, "rows": 256,
                                "threads": 1, "path": "kernel", "us": {"torch": 900.0, "kernel": 500.0}},
                               {"dtype": "float32", "heads": 8, "kv_heads": 2, "head_dim": 64, "rows": 32,
                                "threads": 1, "path": "torch", "us": {"torch": 50.0, "kernel": 52.0}, "limits": ""},
                               {"dtype": "float32", "heads": 8, "kv_heads": 2, "head_dim": 64, "rows": 32,
                                "threads": 1, "path": "kernel", "us": {"torch": 90.0, "kernel": 40.0}, "limits": "wk"}],
         "expert_products": [{"weight": [8, 512, 1024], "layout": "kn", "rows": 128, "threads": 1, "kernel": True,
                              "path": "kernel", "us": {"grouped_mm": 2350.4, "onednn": 2970.0, "kernel": 1279.6}}]}
    throughput_report.print_fused([r])
    out = capsys.readouterr().out
    assert ("decode attention in hf_paged's worker, 64 requests, float32 pages, 8/2 heads of 64, 1 threads: keys "
            "(measured: torch 8000 us, keys 600 us, vector 630 us)") in out
    assert ("prompt attention in hf_paged's worker, 64 requests, float32, 8/2 heads of 64, 1 threads: <=32 tokens "
            "SDPA (SDPA 50 us, kernel 52 us); <=32 tokens (wk) kernel (SDPA 90 us, kernel 40 us); <=256 tokens kernel "
            "(SDPA 900 us, kernel 500 us)") in out
    assert ("expert products in hf_paged's worker, 64 requests, 1 threads: 8x512x1024 float32 (kn) <=128 rows kernel "
            "(grouped_mm 2350 us, onednn 2970 us, kernel 1280 us)") in out


def test_the_warm_up_has_the_timed_calls_size(restore, monkeypatch):
    """One-time costs of the timed call's shapes (hf_paged's few-row linear probes, oneDNN's set-up) fall in the
    warm-up: prompts of the timed ones' lengths, other tokens (no prefix-cache hits), 4 new tokens."""
    calls = []

    def recording(model):
        def run(prompts, max_tokens):
            calls.append((prompts, max_tokens))
            return [[0] * max_tokens for _ in prompts]
        return run

    monkeypatch.setattr(throughput, "padded_runner", recording)
    throughput.measure("hf_padded", 5, SimpleNamespace(arch="llama", dtype="float32", max_tokens=3), TINY, 1)
    (warm, warm_tokens), (timed, timed_tokens) = calls
    assert (len(warm), warm_tokens, len(timed), timed_tokens) == (5, 4, 5, 3)
    assert [len(p) for p in warm] == [len(p) for p in timed]  # the same row buckets, prefill chunks, padded width
    assert all(w[:16] != t[:16] for w, t in zip(warm, timed))  # no first block in common: no prefix-cache hit


@pytest.mark.parametrize("open_after", [[0], [2, 0], [3, 3, 3]])
def test_hf_pageds_warm_up_runs_its_trials_to_the_end(restore, monkeypatch, open_after):
    """hf_paged's trials of few-row products take up to 3 x (1 + SAMPLES) calls per row bucket: its warm-up generates
    that many tokens more and runs again while any is open (at most MAX_WARMUPS times); the JSON says how it ended."""
    calls, left = [], list(open_after)

    def recording(model):
        def run(prompts, max_tokens):
            calls.append(max_tokens)
            return [[0] * max_tokens for _ in prompts]
        return run

    monkeypatch.setattr(throughput, "paged_runner", recording)
    monkeypatch.setattr(throughput, "open_trials", lambda: left.pop(0) if len(left) > 1 else left[0])
    r = throughput.measure("hf_paged", 2, SimpleNamespace(arch="llama", dtype="float32", max_tokens=3), TINY, 1)
    warmups = min(len(open_after), throughput.MAX_WARMUPS)
    assert calls == [3 * (1 + SAMPLES) + 4] * warmups + [3]
    assert (r["warmups"], r["open_trials"]) == (warmups, open_after[-1])


@pytest.mark.parametrize("enabled", [True, False])
def test_small_runs_in_this_process_and_puts_back_what_it_changed(restore, enabled):
    """--small needs no worker (this process has imported transformers already); the take-over's state and the
    thread count are as before, whatever the systems switched; the results are plain JSON values, as a worker's."""
    import torch

    (hf_paged.enable if enabled else hf_paged.disable)()
    torch.set_num_threads(2)
    args = SimpleNamespace(arch="llama", dtype="float32", max_tokens=3, threads=1, requests=[2],
                           systems=["hf_paged", "hf_padded"])
    out = throughput.small_in_process(args, TINY)
    assert hf_paged.is_enabled() is enabled and torch.get_num_threads() == 2
    assert out["matmul"]["threads"] == 1 and out["matmul"]["gflops"] > 0
    assert [(r["system"], r["requests"], r["threads"]) for r in out["results"]] == [("hf_paged", 2, 1),
                                                                                   ("hf_padded", 2, 1)]
    assert out["results"][0]["tokens"] == out["results"][1]["tokens"]
    assert out == json.loads(json.dumps(out))


def worker_result(system, n, seconds, tokens, cpu=None):
    return {"system": system, "requests": n, "seconds": seconds, "cpu_seconds": cpu or seconds, "threads": 2,
            "output_tokens": sum(len(t) for t in tokens), "peak_rss_mb": 100.0, "tokens": tokens,
            "params": {"total": 1000, "embedding": 100, "lm_head": 100, "non_embedding": 800}}


def test_report_arithmetic(monkeypatch, tmp_path, capsys):
    """Stand-in workers at 2 requests x 3 tokens: hf_paged 1 s, hf_padded 2 s (one row differs), generate_batch
    fails. tok/s = 6 / seconds; the matmul limit: 2 x non-embedding x (prompt + output) + 2 x lm_head x output
    FLOPs at 1 GFLOP/s."""
    calls = []

    def run_worker(argv, timeout=None):
        worker = argv[argv.index("--worker") + 1]
        calls.append(worker)
        if worker == "matmul":
            return {"gflops": 1.0, "threads": 2}
        if worker == "hf_generate_batch":
            raise RuntimeError("no such method")
        n = int(argv[argv.index("--requests") + 1])
        rows = [[5, 6, 7], [8, 9, 10]] if worker == "hf_paged" else [[5, 6, 7], [8, 9, 11]]
        return worker_result(worker, n, 1.0 if worker == "hf_paged" else 2.0, rows, cpu=0.5 if worker == "hf_paged"
                             else 2.0)

    monkeypatch.setattr(throughput, "run_worker", run_worker)
    out = tmp_path / "t.json"
    assert throughput.main(["--requests", "2", "--max-tokens", "3", "--json", str(out)]) == 1  # a system failed
    assert calls == ["matmul", "hf_paged", "hf_padded", "hf_generate_batch"]
    report = json.loads(out.read_text())
    paged, padded, failed = report["results"]
    assert failed == {"system": "hf_generate_batch", "requests": 2, "error": "no such method"}
    prompt_tokens = sum(len(p) for p in throughput.make_prompts(2, 32000, 16, 200))
    assert paged["prompt_tokens"] == padded["prompt_tokens"] == prompt_tokens
    assert paged["tok_per_s"] == 6.0 and padded["tok_per_s"] == 3.0 and paged["complete"] is True
    assert paged["vs_hf_padded"] == 2.0 and padded["vs_hf_padded"] == 1.0 and paged["vs_hf_padded_cpu"] == 4.0
    assert paged["vs_hf_generate_batch"] is None
    assert paged["same_as_hf_padded"] == 1 and padded["same_as_hf_padded"] == 2
    flops = 2 * 800 * (prompt_tokens + 6) + 2 * 100 * 6
    limit = 6 / (flops / 1e9)
    assert report["matmul_limit_tok_per_s"] == {"2": pytest.approx(limit)}
    assert paged["matmul_limit_fraction"] == pytest.approx(6.0 / limit)
    assert "tokens" not in paged and report["threads"] == 2 and report["matmul_gflops"] == 1.0
    printed = capsys.readouterr().out
    assert "hf_generate_batch         2 requests: FAILED" in printed and "1/2" in printed


def test_incomplete_outputs_are_marked(monkeypatch, tmp_path):
    def run_worker(argv, timeout=None):
        worker = argv[argv.index("--worker") + 1]
        if worker == "matmul":
            return {"gflops": 1.0, "threads": 1}
        return worker_result(worker, 1, 1.0, [[5]])  # 1 token where 3 were asked

    monkeypatch.setattr(throughput, "run_worker", run_worker)
    out = tmp_path / "t.json"
    assert throughput.main(["--requests", "1", "--max-tokens", "3", "--systems", "hf_paged", "--json", str(out)]) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert r["complete"] is False and r["vs_hf_padded"] is None and r["same_as_hf_padded"] is None


def choice(shape, rows, path):
    return {"shape": shape, "rows": rows, "threads": 1, "path": path, "probe_ms": 0.5,
            "us": {"kernel": 1.0, "w_xt": 2.0, "f_linear": 3.0}}


def test_small_linear_paths_and_table(capsys):
    r = {"requests": 4, "small_linears": {"status": "native kernel, W @ x^T or F.linear; chosen: ...",
                                          "choices": [choice([64, 32], 4, "kernel"), choice([300, 32], 1, "w_xt")]}}
    assert throughput_report._linear_paths(r) == {"64x32 float32 rows<=4 threads=1": "kernel",
                                                  "300x32 float32 rows<=1 threads=1": "w_xt"}
    assert throughput_report._linear_paths({}) == {}
    r["round_small_linear_paths"] = [throughput_report._linear_paths(r), {"64x32 float32 rows<=4 threads=1": "f_linear"}]
    throughput_report.print_small_linears([r, {"requests": 8}])
    out = capsys.readouterr().out
    assert "4 requests (fastest round; rounds chose differently): native kernel, W @ x^T or F.linear\n" in out
    assert "chosen: ..." not in out and "64x32" in out and "300x32" in out and "8 requests" not in out
    r["round_small_linear_paths"] = r["round_small_linear_paths"][:1] * 2
    throughput_report.print_small_linears([r])
    assert "all rounds chose alike" in capsys.readouterr().out


def test_the_matmul_limit_counts_the_expert_weights_a_token_uses():
    """A mixture of 4 experts, 2 per token: half of each layer's expert weights are idle for a token; a dense model
    has none."""
    from hf_paged.bench.throughput_models import build_model, workload

    model = build_model("gpt_oss", workload("gpt_oss", small=True)["model"])
    experts = [m for m in model.modules() if type(m).__name__ == "GptOssExperts"]
    assert len(experts) == 4 and model.config.num_experts_per_tok == 2 and experts[0].num_experts == 4
    assert throughput.idle_expert_params(model) == sum(p.numel() for m in experts for p in m.parameters()) // 2
    assert throughput.idle_expert_params(build_model("llama", workload("llama", small=True)["model"])) == 0


def test_the_matmul_limit_of_a_mixture_uses_its_active_weights():
    """2 requests x 3 tokens at 1 GFLOP/s: FLOPs = 2 x (weights used per token) x (prompt + output) + 2 x lm_head x
    output, with 400 of the 800 non-embedding weights used per token."""
    args = SimpleNamespace(requests=[2], max_tokens=3)
    params = {"total": 1000, "embedding": 100, "lm_head": 100, "non_embedding": 800, "active_non_embedding": 400}
    limits, _ = throughput_report.summarise(args, {2: 10}, 1.0, params, [])
    assert limits[2] == pytest.approx(6 / ((2 * 400 * 16 + 2 * 100 * 6) / 1e9))
