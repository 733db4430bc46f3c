"""GPU measurements for benchmarks/gpu_check.sh, one subcommand per step (each writes OUTDIR/<step>.json), run as
`python -m hf_paged.bench.gpu_check STEP OUTDIR` from the source checkout (parity reads its tests/conftest.py):

    ceilings  device<->device copy GB/s, pinned host<->device GB/s, bf16 matmul TFLOP/s (8192^3)
    decode    decode attention per available backend: batch 64, context 2048, 32 query / 8 KV heads, head_dim 128,
              bf16, block 16 (flash2: block 256, its page rule); achieved GB/s = K+V bytes read / median time
              (CUDA events, 50 runs), as a fraction of the measured device copy bandwidth. The CUDA kernel also with
              forced partition sizes, and one long-context case (batch 4, context 32768) where splitting matters.
    swap      host<->device block moves of a ~1B model's KV blocks (16 layers, 8 KV heads, head_dim 64, block 16,
              bf16: 512 KiB per block): one copy per block (scattered ids), contiguous runs (consecutive ids, as
              hf_paged.kv.swap.copy_blocks groups them), and the CUDA copy_blocks kernel (one launch, scattered).
    engine    hf_paged LLM (attention_backend="auto") vs transformers' generate_batch on a random-weight ~1.1B Llama
              (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate 8192, vocab 32000, bf16): 64 prompts of
              128-512 random tokens, 128 greedy new tokens each (EOS ignored); plus the model's prefill tok/s, and
              the swap-vs-recompute break-even from the swap step's bandwidth.
              Also HF padded generate (one left-padded batch) on the same prompts.
    parity    generate(cache_implementation="paged") vs HF generate per tiny architecture, fp32 and bf16: identical rows
              and HF's top-2 margin where a row first differs.
    table     the summary of whatever JSON files exist.

Without CUDA every step prints "skipped: no CUDA" and records that (so the script can be dry-run on a CPU box).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from .common import format_table
from .gpu_engine import hf_padded_generate, llama_and_prompts, profile, step_times, timed_generate
from .gpu_parity import parity


def _cuda():
    import torch

    return torch.cuda.is_available()


def _save(outdir: Path, step: str, data: dict) -> None:
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / f"{step}.json").write_text(json.dumps(data, indent=2) + "\n")


def _load(outdir: Path, step: str) -> dict:
    path = outdir / f"{step}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def time_cuda(fn, repeats: int = 50, warmup: int = 5) -> float:
    """Median seconds of fn() by CUDA events."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


# ---- ceilings ---------------------------------------------------------------------------------------------
def _copy_bandwidths() -> tuple[float, float, float]:
    """Bytes per second: device -> device (read + write counted), pinned host -> device, device -> pinned host."""
    import torch

    n = 1 << 30  # 1 GiB
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    d2d = 2 * n / time_cuda(lambda: dst.copy_(src), repeats=20)
    h2d = n / time_cuda(lambda: src.copy_(host, non_blocking=True), repeats=10)
    d2h = n / time_cuda(lambda: host.copy_(src, non_blocking=True), repeats=10)
    return d2d, h2d, d2h


def _matmul_tflops(size: int = 8192) -> float:
    import torch

    x = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    y = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    return 2 * size**3 / time_cuda(lambda: x @ y, repeats=20) / 1e12


def ceilings(outdir: Path) -> dict:
    import torch

    d2d, h2d, d2h = _copy_bandwidths()
    torch.cuda.empty_cache()
    return {"d2d_copy_GBps": d2d / 1e9, "h2d_pinned_GBps": h2d / 1e9, "d2h_pinned_GBps": d2h / 1e9,
            "bf16_matmul_TFLOPs": _matmul_tflops(), "device": torch.cuda.get_device_name()}


# ---- decode attention -------------------------------------------------------------------------------------
def decode_case(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype):
    import torch

    from hf_paged.attention import AttentionMetadata

    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq + 1
    perm = torch.randperm(num_blocks - 1).tolist()  # pages scattered over the pool, as after real traffic
    tables = [perm[i * blocks_per_seq:(i + 1) * blocks_per_seq] for i in range(batch)]
    slots = [t[(context - 1) // block_size] * block_size + (context - 1) % block_size for t in tables]
    meta = AttentionMetadata.build([1] * batch, [context] * batch, tables, slots, block_size, torch.device("cuda"))
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    q = torch.randn(batch, heads, head_dim, dtype=dtype, device="cuda")
    kv_bytes = 2 * batch * context * kv_heads * head_dim * k.element_size()
    return q, k, v, meta, kv_bytes


def decode(outdir: Path) -> dict:
    import torch

    from hf_paged.attention import cuda_backend, paged_attention, why_not

    copy_gbps = _load(outdir, "ceilings").get("d2d_copy_GBps")
    rows = []

    def measure(label, backend, case, **options):
        q, k, v, meta, kv_bytes = case
        reason = why_not(backend, q, k, meta, None, None)
        if reason is not None:
            rows.append({"case": label, "backend": backend, "skipped": reason})
            print(f"  {label:<34} {backend:<10} skipped: {reason}", flush=True)
            return
        if options:
            fn = lambda: cuda_backend.paged_attention(q, k, v, meta, 0.088, None, None, **options)
        else:
            fn = lambda: paged_attention(q, k, v, metadata=meta, scale=0.088, backend=backend)
        try:
            seconds = time_cuda(fn)
        except Exception as e:  # noqa: BLE001 - report, keep measuring the others
            rows.append({"case": label, "backend": backend, "error": f"{type(e).__name__}: {e}"[:500]})
            print(f"  {label:<34} {backend:<10} FAILED: {e}", flush=True)
            return
        gbps = kv_bytes / seconds / 1e9
        row = {"case": label, "backend": backend + (f" {options}" if options else ""), "us": seconds * 1e6,
               "GBps": gbps, "of_copy_bw": gbps / copy_gbps if copy_gbps else None}
        rows.append(row)
        print(f"  {label:<34} {row['backend']:<28} {seconds * 1e6:9.1f} us {gbps:8.1f} GB/s", flush=True)

    llama8b = dict(heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    case16 = decode_case(64, 2048, block_size=16, **llama8b)
    for backend in ("cuda", "flash3", "flashinfer", "triton", "torch"):
        measure("b64 ctx2048 block16", backend, case16)
    cuda_ok = cuda_backend.unavailable_reason(torch.device("cuda")) is None
    if cuda_ok:
        for partition in (-1, 256, 512, 1024):
            measure("b64 ctx2048 block16", "cuda", case16, partition_size=partition)
    del case16
    if cuda_ok:  # the split rule's middle ground: 128 thread blocks on 132 SMs
        mid = decode_case(16, 4096, block_size=16, **llama8b)
        for partition in (0, -1, 512, 1024):
            measure("b16 ctx4096 block16", "cuda", mid, partition_size=partition)
        del mid
    case256 = decode_case(64, 2048, block_size=256, **llama8b)
    for backend in ("flash2", "cuda", "flash3", "flashinfer"):
        measure("b64 ctx2048 block256", backend, case256)
    del case256
    long = decode_case(4, 32768, block_size=16, **llama8b)
    for backend in ("cuda", "flash3", "flashinfer", "triton"):
        measure("b4 ctx32768 block16", backend, long)
    if cuda_ok:
        measure("b4 ctx32768 block16", "cuda", long, partition_size=-1)
    return {"copy_GBps": copy_gbps, "rows": rows, "cuda_extension": cuda_backend.extension_status()}


# ---- swap -------------------------------------------------------------------------------------------------
SWAP_SHAPE = dict(layers=16, kv_heads=8, head_dim=64, block_size=16)


def swap(outdir: Path) -> dict:
    import torch

    from hf_paged.attention import cuda_backend
    from hf_paged.kv.swap import contiguous_runs, copy_blocks

    s = SWAP_SHAPE
    pool, moved = 2048, 512
    shape = (s["layers"], 2, pool, s["block_size"], s["kv_heads"], s["head_dim"])
    device = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    host = torch.empty(shape, dtype=torch.bfloat16, pin_memory=True)
    block_bytes = device[:, :, :1].numel() * device.element_size()
    scattered = random.Random(0).sample(range(pool), moved)
    consecutive = list(range(100, 100 + moved))
    rows = []

    def measure(label, fn, ids_src, ids_dst):
        fn(ids_src, ids_dst)
        torch.cuda.synchronize()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn(ids_src, ids_dst)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        seconds = min(times)
        rows.append({"method": label, "blocks": moved, "MiB": moved * block_bytes / 2**20, "ms": seconds * 1e3,
                     "GBps": moved * block_bytes / seconds / 1e9})
        print(f"  {label:<48} {seconds * 1e3:8.2f} ms {rows[-1]['GBps']:7.2f} GB/s", flush=True)

    for direction, (src, dst) in (("out", (device, host)), ("in", (host, device))):
        measure(f"swap {direction}: one copy per block (scattered)",
                lambda a, b: copy_blocks(src, dst, a, b), scattered, random.Random(1).sample(range(pool), moved))
        assert len(contiguous_runs(consecutive, consecutive)) == 1
        measure(f"swap {direction}: contiguous runs (1 run)", lambda a, b: copy_blocks(src, dst, a, b),
                consecutive, consecutive)
        if cuda_backend.unavailable_reason(torch.device("cuda")) is None:
            measure(f"swap {direction}: copy_blocks kernel (scattered, 1 launch)",
                    lambda a, b: cuda_backend.copy_blocks(src, dst, a, b), scattered, scattered)
    return {"shape": s, "block_bytes": block_bytes, "rows": rows}


# ---- engine vs HF -----------------------------------------------------------------------------------------
MODEL = dict(vocab_size=32000, hidden=2048, layers=16, heads=32, kv_heads=8, max_len=4096, intermediate_size=8192)


def engine(outdir: Path, requests: int, max_tokens: int) -> dict:
    import torch

    import hf_paged

    model, prompts = llama_and_prompts(MODEL, requests)
    params_count = sum(p.numel() for p in model.parameters())
    prompt_tokens = sum(map(len, prompts))
    result = {"model": MODEL, "params": params_count, "requests": requests, "max_tokens": max_tokens,
              "prompt_tokens": prompt_tokens, "rows": []}

    # prefill rate of the bare model (dense attention): the recompute side of the break-even
    ids = torch.randint(3, MODEL["vocab_size"], (8, 512), device="cuda")
    with torch.no_grad():
        seconds = time_cuda(lambda: model(ids, use_cache=False), repeats=5, warmup=2)
    result["prefill_tok_s"] = ids.numel() / seconds
    print(f"  prefill: {result['prefill_tok_s']:.0f} tok/s (8 x 512 tokens, one forward)", flush=True)

    params = hf_paged.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm = hf_paged.LLM(model, block_size=16, max_num_seqs=256, max_num_batched_tokens=8192,
                       kv_cache_memory=16 * 2**30, attention_backend="auto")
    llm.generate(prompts[:2], hf_paged.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)

    def paged_row(system: str, seconds: float) -> None:
        result["rows"].append({"system": system, "seconds": seconds, "out_tok_s": requests * max_tokens / seconds,
                               "total_tok_s": (prompt_tokens + requests * max_tokens) / seconds})
        print(f"  {system}: {seconds:.2f} s, {requests * max_tokens / seconds:.0f} output tok/s", flush=True)

    seconds, outputs = timed_generate(llm, prompts, params)
    paged_tokens = [list(o.outputs[0].token_ids) for o in outputs]
    paged_row("hf_paged (auto)", seconds)
    # a second call on new prompts of the same lengths (no prefix hits): decode graphs are captured by now
    rng = random.Random(1)
    other = [[rng.randrange(3, MODEL["vocab_size"]) for _ in prompt] for prompt in prompts]
    paged_row("hf_paged (auto), 2nd call", timed_generate(llm, other, params)[0])
    result["steps"] = step_times(llm, prompts, params)  # the first run again, step by step
    print(f"  hf_paged step by step: {result['steps']}", flush=True)
    del llm
    torch.cuda.empty_cache()

    hf_tokens: list = []
    try:
        from hf_paged.tiny import generate_batch_configs

        hf_paged.disable()
        config, _ = generate_batch_configs(max_tokens)
        model.generate_batch(inputs=prompts[:2], generation_config=generate_batch_configs(4)[0], progress_bar=False,
                             warmup=False)
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf_out = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False, warmup=False)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        hf_tokens = [list(o.generated_tokens) for o in hf_out.values()]
        same = sum(a == b for a, b in zip(paged_tokens, hf_tokens))
        result["rows"].append({"system": "HF generate_batch", "seconds": seconds,
                               "out_tok_s": requests * max_tokens / seconds,
                               "total_tok_s": (prompt_tokens + requests * max_tokens) / seconds,
                               "same_tokens_as_hf_paged": f"{same}/{requests}"})
        print(f"  HF generate_batch: {seconds:.2f} s, {requests * max_tokens / seconds:.0f} output tok/s "
              f"({same}/{requests} rows identical to hf_paged; bf16 may differ)", flush=True)
    except Exception as e:  # noqa: BLE001
        result["rows"].append({"system": "HF generate_batch", "error": f"{type(e).__name__}: {e}"[:500]})
        print(f"  HF generate_batch FAILED: {e}", flush=True)

    hf_padded_generate(model, prompts, max_tokens, paged_tokens, hf_tokens, result)

    sw = _load(outdir, "swap")
    if sw.get("rows"):
        bytes_per_token = sw["block_bytes"] / SWAP_SHAPE["block_size"]
        best = max(r["GBps"] for r in sw["rows"]) * 1e9
        swap_s = 2 * bytes_per_token / best  # out and back in, per token
        recompute_s = 1 / result["prefill_tok_s"]
        result["break_even"] = {"bytes_per_token": bytes_per_token, "best_swap_GBps": best / 1e9,
                                "swap_us_per_token": swap_s * 1e6, "recompute_us_per_token": recompute_s * 1e6,
                                "swap_cheaper_by": recompute_s / swap_s}
        print(f"  break-even: swap {swap_s * 1e6:.2f} us/token vs recompute {recompute_s * 1e6:.2f} us/token", flush=True)
    return result


# ---- table ------------------------------------------------------------------------------------------------
def table(outdir: Path) -> str:
    lines = []
    c = _load(outdir, "ceilings")
    if c and "skipped" not in c:
        lines.append(f"ceilings ({c.get('device')}): device copy {c['d2d_copy_GBps']:.0f} GB/s, pinned H2D "
                     f"{c['h2d_pinned_GBps']:.1f} GB/s, D2H {c['d2h_pinned_GBps']:.1f} GB/s, bf16 matmul "
                     f"{c['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    d = _load(outdir, "decode")
    if d.get("rows"):
        rows = [[r["case"], r["backend"], r.get("us"), r.get("GBps"),
                 f"{100 * r['of_copy_bw']:.0f}%" if r.get("of_copy_bw") else None,
                 (r.get("skipped") or r.get("error") or "")[:60]] for r in d["rows"]]
        lines.append(format_table(["decode case", "backend", "us", "GB/s", "of copy", "note"], rows))
    s = _load(outdir, "swap")
    if s.get("rows"):
        lines.append(format_table(["swap method", "MiB", "ms", "GB/s"],
                                  [[r["method"], r["MiB"], r["ms"], r["GBps"]] for r in s["rows"]]))
    e = _load(outdir, "engine")
    if e.get("rows"):
        lines.append(format_table(["system (~1.1B Llama bf16)", "seconds", "out tok/s", "total tok/s", "note"],
                                  [[r["system"], r.get("seconds"), r.get("out_tok_s"), r.get("total_tok_s"),
                                    r.get("same_tokens_as_hf_paged") or r.get("error", "")[:60]] for r in e["rows"]]))
        if "break_even" in e:
            b = e["break_even"]
            lines.append(f"swap vs recompute: {b['swap_us_per_token']:.2f} vs {b['recompute_us_per_token']:.2f} "
                         f"us per token -> swap is {b['swap_cheaper_by']:.1f}x cheaper (best swap "
                         f"{b['best_swap_GBps']:.1f} GB/s, prefill {e['prefill_tok_s']:.0f} tok/s)")
    pa = _load(outdir, "parity")
    if pa.get("rows"):
        lines.append(format_table(["parity with HF (tiny, padded)", "identical rows", "largest HF margin at a divergence"],
                                  [[r["case"], r.get("identical"), r.get("max_margin") if r.get("identical")
                                    else r.get("error", "")[:60]] for r in pa["rows"]]))
    skipped = [name for name in ("ceilings", "decode", "swap", "engine", "parity") if "skipped" in _load(outdir, name)]
    if skipped:
        lines.append(f"skipped (no CUDA): {', '.join(skipped)}")
    return "\n\n".join(lines) if lines else "no results"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_paged.bench.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("step", choices=("ceilings", "decode", "swap", "engine", "parity", "profile", "table"))
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    if args.step == "table":
        print(table(args.outdir))
        return 0
    if not _cuda():
        print(f"{args.step}: skipped: no CUDA")
        _save(args.outdir, args.step, {"skipped": "no CUDA"})
        return 0
    print(f"== {args.step}", flush=True)
    if args.step == "ceilings":
        data = ceilings(args.outdir)
    elif args.step == "decode":
        data = decode(args.outdir)
    elif args.step == "swap":
        data = swap(args.outdir)
    elif args.step == "parity":
        data = parity(args.outdir)
    elif args.step == "profile":
        data = profile(args.outdir, args.requests, MODEL)
    else:
        data = engine(args.outdir, args.requests, args.max_tokens)
    _save(args.outdir, args.step, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
