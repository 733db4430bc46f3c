"""bench/throughput_report.py: the figures derived from the workers' results (speed-ups, share of the matmul limit,
same tokens) and the table's rows."""
from types import SimpleNamespace

from hf_paged.bench.throughput_report import print_round_differences, summarise


def test_speed_ups_limit_share_and_same_tokens():
    args = SimpleNamespace(requests=[2], max_tokens=4)
    params = {"non_embedding": 1000, "lm_head": 500, "total": 2000}
    results = [
        {"system": "hf_paged", "requests": 2, "seconds": 2.0, "cpu_seconds": 2.0, "output_tokens": 8,
         "peak_rss_mb": 10.0, "tokens": [[1, 2, 3, 4], [5, 6, 7, 9]]},
        {"system": "hf_padded", "requests": 2, "seconds": 4.0, "cpu_seconds": 6.0, "output_tokens": 8,
         "peak_rss_mb": 12.0, "tokens": [[1, 2, 3, 4], [5, 6, 7, 8]]},
    ]
    limits, rows = summarise(args, {2: 12}, gflops=1e-3, params=params, results=results)
    paged, padded = results
    flops = 2 * 1000 * (12 + 8) + 2 * 500 * 8
    assert abs(limits[2] - 8 / (flops / 1e6)) < 1e-9
    assert paged["tok_per_s"] == 4.0 and paged["vs_hf_padded"] == 2.0 and paged["vs_hf_padded_cpu"] == 3.0
    assert abs(paged["matmul_limit_fraction"] - 4.0 / limits[2]) < 1e-12
    assert paged["same_as_hf_padded"] == 1 and paged["complete"] and "tokens" not in paged and "tokens" not in padded
    assert rows[0][0] == "hf_paged" and rows[0][-1] == "1/2" and rows[1][-1] is None and rows[0][6] == 2.0


def test_small_linear_table_shows_the_products_each_worker_measured(capsys):
    """fp32 (kernel, W @ x^T, F.linear) and bf16 (packed, F.linear) choices: one column per product measured."""
    from hf_paged.bench.throughput_report import print_small_linears

    choices = [{"shape": [512, 512], "dtype": "float32", "rows": 4, "threads": 1, "path": "kernel",
                "us": {"kernel": 10.0, "w_xt": 20.0, "f_linear": 30.0}, "probe_ms": 0.5},
               {"shape": [32000, 512], "dtype": "bfloat16", "rows": 64, "threads": 1, "path": "packed",
                "us": {"packed": 1400.0, "f_linear": 2500.0}, "probe_ms": 9.0}]
    print_small_linears([{"requests": 4, "small_linears": {"status": "measured; chosen: ...", "choices": choices}}])
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("weight"))
    assert header.split() == ["weight", "dtype", "rows", "<=", "threads", "chosen", "kernel", "us", "W", "@", "x^T",
                              "us", "packed", "us", "F.linear", "us", "trial", "ms"]
    row = next(line for line in lines if line.startswith("32000x512"))
    assert row.split() == ["32000x512", "bfloat16", "64", "1", "packed", "-", "-", "1400.00", "2500.00", "9.00"]


def test_rounds_that_disagree_on_tokens_are_printed(capsys):
    print_round_differences([{"system": "hf_padded", "requests": 4},
                             {"system": "hf_paged", "requests": 64, "round_rows_differ": [0, 3]}])
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "hf_paged 64 requests" in out and "round by round: 0 3" in out


def test_fused_passes_are_printed(capsys):
    from hf_paged.bench.throughput_report import print_fused

    print_fused([{"requests": 64, "fused": {"norms": 17, "norms_status": "loaded", "rotary": 8,
                                            "rotary_status": "loaded"}}, {"requests": 64}])
    out = capsys.readouterr().out
    assert "RMSNorm on 17 modules (loaded), rotary embedding on 8 attention modules (loaded)" in out
    assert out.count("fused passes") == 1
