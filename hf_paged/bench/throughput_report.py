"""The throughput benchmark's figures and table from its workers' results: speed-ups (wall and CPU time, round by
round), the share of the matmul limit, same tokens, and which small-linear products the paged worker chose."""
from __future__ import annotations

import statistics

from .common import format_table


def _linear_paths(result: dict) -> dict[str, str]:
    """A worker's small-linear choices as {"out x in rows<=b threads=t": path}."""
    return {f"{c['shape'][0]}x{c['shape'][1]} {c.get('dtype', 'float32')} rows<={c['rows']} threads={c['threads']}":
            c["path"]
            for c in result.get("small_linears", {}).get("choices", [])}


def print_fused(results: list[dict]) -> None:
    """The native RMSNorm and rotary passes each hf_paged worker's engine took (fused_norms / fused_rotary), and the
    path its CPU decode attention took per layer shape (attention/decode_choice) and its fresh prompts' attention per
    shape and prompt-length bucket (attention/prefill_kernel), and its mixture experts' products per weight and
    row bucket (model/expert_products), and whether its steps ran those paths at all, per row bucket
    (model/step_choice)."""
    for r in results:
        if fused := r.get("fused"):
            print(f"\nfused passes in hf_paged's worker, {r['requests']} requests: RMSNorm on {fused['norms']} modules "
                  f"({fused['norms_status']}), rotary embedding on {fused['rotary']} attention modules "
                  f"({fused['rotary_status']}); each bit for bit transformers' and timed faster here")
        for c in r.get("decode_attention", []):
            times = ", ".join(f"{name} {us:.0f} us" for name, us in c["us"].items())
            print(f"decode attention in hf_paged's worker, {r['requests']} requests, {c['dtype']} pages, "
                  f"{c['heads']}/{c['kv_heads']} heads of {c['head_dim']}, {c['threads']} threads: {c['path']} "
                  f"({c['source']}{': ' + times if times else ''})")
        buckets = [f"<={c['rows']} tokens{' (' + c['limits'] + ')' if c.get('limits') else ''} "
                   f"{'SDPA' if c['path'] == 'torch' else c['path']} ("
                   + ", ".join(f"{'SDPA' if n == 'torch' else n} {us:.0f} us" for n, us in c["us"].items()) + ")"
                   for c in sorted(r.get("prefill_attention", []), key=lambda c: (c["rows"], c.get("limits", "")))]
        if buckets:
            c = r["prefill_attention"][0]
            print(f"prompt attention in hf_paged's worker, {r['requests']} requests, {c['dtype']}, {c['heads']}/"
                  f"{c['kv_heads']} heads of {c['head_dim']}, {c['threads']} threads: {'; '.join(buckets)}")
        experts = [f"{'x'.join(map(str, c['weight']))} {c.get('dtype', 'float32')} ({c['layout']}) <={c['rows']} rows "
                   f"{c['path']} ("
                   + ", ".join(f"{n} {us:.0f} us" for n, us in c["us"].items()) + ")"
                   for c in sorted(r.get("expert_products", []), key=lambda c: (c["weight"], c["rows"]))]
        if experts:
            print(f"expert products in hf_paged's worker, {r['requests']} requests, "
                  f"{r['expert_products'][0]['threads']} threads: {'; '.join(experts)}")
        steps = [f"<={c['rows']} rows {c['path']} (" + ", ".join(f"{n} {ms:.2f} ms" for n, ms in c["ms"].items()) + ")"
                 for c in r.get("step_paths", [])]
        if steps:
            print(f"steps with the fast paths on or off (plain) in hf_paged's worker, {r['requests']} requests: "
                  + "; ".join(steps))


def print_small_linears(results: list[dict]) -> None:
    """The few-row linear products hf_paged's workers measured and chose (model/linear_choice.py), per weight shape
    and row bucket: each candidate's median time in us over its timed calls inside the steps (a candidate dropped
    early: its better call), and whether every round chose alike."""
    for r in results:
        if not r.get("small_linears"):
            continue
        rounds = r.get("round_small_linear_paths", [])
        same = all(paths == rounds[0] for paths in rounds)
        status = r["small_linears"]["status"].split("; chosen:")[0]  # the choices: the table below
        warmed = f"{r['warmups']} warm-ups, {r['open_trials']} trials still open at the timed call; " \
            if "warmups" in r else ""
        print(f"\nsmall linears in hf_paged's worker, {r['requests']} requests (fastest round; {warmed}"
              f"{'all rounds chose alike' if same else 'rounds chose differently'}): {status}")
        choices = r["small_linears"]["choices"]
        names = [name for name in PRODUCT_LABELS if any(name in c["us"] for c in choices)]
        rows = [[f"layer of {c['shape'][0]}" if str(c.get("dtype")).startswith("layer")
                 else f"{c['shape'][0]}x{c['shape'][1]}",
                 c.get("dtype", "float32"), c["rows"], c["threads"], c["path"],
                 *(c["us"].get(name) for name in names), c["probe_ms"]] for c in choices]
        if rows:
            print(format_table(["weight", "dtype", "rows <=", "threads", "chosen",
                                *(f"{PRODUCT_LABELS[name]} us" for name in names), "trial ms"], rows))


# the products a measured linear chooses from: fp32 (model/small_linear.py) and bf16 (model/packed_linear.py); a
# greedy step's LM head (dtype "greedy", model/greedy_head.py): its bf16 or int8 screen or its usual product and the
# argmax; a Llama-coded decoder layer (dtype "layer", model/fused_layers.py): its class forward or the fused one
PRODUCT_LABELS = {"kernel": "kernel", "w_xt": "W @ x^T", "wt_copy": "x @ W^T copy", "onednn": "oneDNN",
                  "packed": "packed", "f_linear": "F.linear", "class": "layer's class forward", "fused": "fused layer",
                  "fused_onednn": "fused on oneDNN",
                  "screen": "bf16 screen", "screen_i8": "int8 screen", "logits": "head + argmax"}


def _paired_ratios(results: list[dict], n: int, system: str, base: str) -> list[float] | None:
    """Per-round speed-up of `system` over `base` (each round ran both back to back), or None."""
    group = {r["system"]: r for r in results if r["requests"] == n and "round_seconds" in r}
    if system not in group or base not in group:
        return None
    return [b / a for a, b in zip(group[system]["round_seconds"], group[base]["round_seconds"])]


def _paired_cpu_ratios(results: list[dict], r: dict) -> list[float] | None:
    """hf_paged's per-round speed-up over hf_padded in worker CPU seconds (`r` is hf_paged's result), or None."""
    padded = next((x for x in results if x["system"] == "hf_padded" and x["requests"] == r["requests"]), {})
    if r["system"] != "hf_paged" or None in (*r.get("round_cpu_seconds", [None]),
                                             *padded.get("round_cpu_seconds", [None])):
        return None
    return [b / a for a, b in zip(r["round_cpu_seconds"], padded["round_cpu_seconds"])]


# --- parent side ---------------------------------------------------------------------------------------
def summarise(args, prompt_tokens: dict[int, int], gflops: float, params: dict | None,
              results: list[dict]) -> tuple[dict, list]:
    """Annotate `results` in place (tok/s, speed-ups, round-by-round ratios, share of the matmul limit, same tokens;
    the tokens themselves dropped) and return (the matmul-limit tok/s per request count, the table's rows).
    `prompt_tokens`: the workload's prompt tokens per request count."""
    limits, rows = {}, []
    for n in args.requests:
        output_tokens = n * args.max_tokens
        used = params.get("active_non_embedding", params["non_embedding"]) if params else 0  # a mixture: top-k
        flops = 2 * used * (prompt_tokens[n] + output_tokens) + 2 * params["lm_head"] * output_tokens \
            if params else None
        limits[n] = output_tokens / (flops / (gflops * 1e9)) if flops else None
        group = {r["system"]: r for r in results if r["requests"] == n and "error" not in r}
        reference = group.get("hf_padded", {}).get("tokens")
        for r in group.values():
            r["prompt_tokens"], r["tok_per_s"] = prompt_tokens[n], output_tokens / r["seconds"]
        for r in (r for r in results if r["requests"] == n):
            rows.append(_annotate(r, n, output_tokens, group, reference, limits[n], results))
    for r in results:
        r.pop("tokens", None)
    return limits, rows


def _annotate(r: dict, n: int, output_tokens: int, group: dict, reference, limit, results: list[dict]) -> list:
    """One result's derived figures (in place) and its row of the table."""
    if "error" in r:
        return [r["system"], n, "failed", None, None, None, None, None, None, None, None]
    r["complete"] = r["output_tokens"] == output_tokens
    r["vs_hf_padded"] = r["tok_per_s"] / group["hf_padded"]["tok_per_s"] if "hf_padded" in group else None
    # CPU seconds of the worker process: less sensitive than wall time to other work on the machine
    r["vs_hf_padded_cpu"] = group["hf_padded"]["cpu_seconds"] / r["cpu_seconds"] \
        if "hf_padded" in group and r.get("cpu_seconds") else None
    base = group.get("hf_generate_batch")
    r["vs_hf_generate_batch"] = r["tok_per_s"] / base["tok_per_s"] if base else None
    r["matmul_limit_fraction"] = r["tok_per_s"] / limit if limit else None
    for base in ("hf_padded", "hf_generate_batch"):
        if r["system"] != base and (paired := _paired_ratios(results, n, r["system"], base)):
            r[f"vs_{base}_per_round"] = paired
    if (cpu := _paired_cpu_ratios(results, r)) is not None:
        r["vs_hf_padded_cpu_per_round"] = cpu
    r["same_as_hf_padded"] = sum(a == b for a, b in zip(r["tokens"], reference)) if reference else None
    pct = r["matmul_limit_fraction"]
    same = f"{r['same_as_hf_padded']}/{n}" if reference and r["system"] != "hf_padded" else None
    return [r["system"], n, r["seconds"], r.get("cpu_seconds"), r["tok_per_s"], r["peak_rss_mb"], r["vs_hf_padded"],
            r["vs_hf_padded_cpu"], r["vs_hf_generate_batch"], None if pct is None else f"{100 * pct:.1f}%", same]


def print_round_differences(results: list[dict]) -> None:
    """A line per result whose rounds disagreed on tokens (`round_rows_differ`)."""
    for r in results:
        if differ := r.get("round_rows_differ"):
            print(f"  {r['system']} {r['requests']} requests: rows whose tokens differ from its fastest round's, "
                  f"round by round: {' '.join(map(str, differ))} (each round chose its products afresh: other "
                  f"rounding, flips on near ties)")


def print_report(args, report: dict, rows: list, path) -> None:
    params, limits, results = report["params"], report["matmul_limit_tok_per_s"], report["results"]
    if params:
        active = params.get("active_non_embedding", params["non_embedding"])
        used = f", {active / 1e6:.1f} M of them used per token" if active != params["non_embedding"] else ""
        print(f"\nmodel: {params['total'] / 1e6:.1f} M params ({params['non_embedding'] / 1e6:.1f} M non-embedding"
              f"{used}), "
              f"{args.max_tokens} new tokens/request; matmul-limit output tok/s: "
              + ", ".join(f"{n} req {v:.0f}" for n, v in limits.items() if v))
    print(f"results written to {path}")
    flags = report["machine"].get("cpu_flags")
    print(f"CPU: {report['machine'].get('cpu_model', report['machine']['processor'])}"
          f"{' (' + ' '.join(flags) + ')' if flags else ''}, {report['threads']} torch "
          f"threads; load average (1/5/15 min) before {report['load_average']['before']}, after "
          f"{report['load_average']['after']}\n")
    print(format_table(["system", "requests", "seconds", "CPU s", "out tok/s", "peak RSS MB", "x HF padded",
                        "x padded CPU s", "x HF gen_batch", "of matmul limit", "same tokens as padded"], rows))
    if args.repeats > 1:
        print(f"\nseconds are each system's fastest of {args.repeats} interleaved rounds; speed-ups round by round:")
        for r in results:
            for base in ("hf_padded", "hf_generate_batch"):
                if (paired := r.get(f"vs_{base}_per_round")) and r["system"] == "hf_paged":
                    print(f"  hf_paged x {base:<17} {r['requests']:>3} requests: "
                          + " ".join(f"{v:.2f}" for v in paired) + f"  (median {statistics.median(paired):.2f})")
            if cpu := r.get("vs_hf_padded_cpu_per_round"):
                print(f"  hf_paged x hf_padded, CPU s {r['requests']:>3} requests: "
                      + " ".join(f"{v:.2f}" for v in cpu) + f"  (median {statistics.median(cpu):.2f})")
        print_round_differences(results)
    print_fused(results)
    print_small_linears(results)
