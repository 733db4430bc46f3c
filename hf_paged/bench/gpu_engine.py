"""Parts of the GPU check's engine step (gpu_check.py): HF padded generate on the same work, and the engine step by
step."""
from __future__ import annotations

import random
import statistics
import time

from .gpu_parity import explain_divergences


def step_times(llm, prompts, params) -> dict:
    """Run `prompts` again through `llm`'s engine one step at a time (CUDA graphs already captured by the timed
    run), synchronizing after each step: how many prefill-carrying and decode-only steps, their median and total
    milliseconds, and the graphs' state. The prompts' blocks are still in the prefix cache, so its prefills are
    shorter than the timed run's: read it for the decode steps."""
    import torch

    engine = llm.engine
    for prompt in prompts:
        engine.add_request(prompt, params)
    kinds = {"prefill": [], "decode": []}
    while engine.has_unfinished:
        prompt_tokens = engine.stats()["num_prompt_tokens"]
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        kinds["prefill" if engine.stats()["num_prompt_tokens"] > prompt_tokens else "decode"].append(seconds)
    graphs = engine.runner.graphs
    summary = {kind: {"steps": len(times), "median_ms": statistics.median(times) * 1e3 if times else None,
                      "total_s": sum(times)} for kind, times in kinds.items()}
    summary["graphs"] = graphs.stats() if graphs is not None else None
    return summary


def hf_padded_generate(model, prompts, max_tokens: int, paged_tokens: list, hf_tokens: list, result: dict) -> None:
    """HF padded `generate` (one left-padded batch of every prompt) on the same work as the engine: a row in
    result["rows"], how many of its rows generate_batch matched, and where hf_paged's rows part from it (the float32
    gap between the two tokens chosen, gpu_parity.explain_divergences)."""
    import torch

    import hf_paged

    requests = len(prompts)
    prompt_tokens = sum(map(len, prompts))
    try:  # HF padded generate: one left-padded batch of all the prompts
        hf_paged.disable()
        width = max(map(len, prompts))
        ids = torch.zeros(requests, width, dtype=torch.long, device="cuda")
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        options = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
        with torch.no_grad():
            model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4, **options)
            torch.cuda.synchronize()
            start = time.perf_counter()
            padded = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                    **options)
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        same = sum(padded[row, width:].tolist() == paged_tokens[row] for row in range(requests))
        result["rows"].append({"system": "HF generate (padded)", "seconds": seconds,
                               "out_tok_s": requests * max_tokens / seconds,
                               "total_tok_s": (prompt_tokens + requests * max_tokens) / seconds,
                               "same_tokens_as_hf_paged": f"{same}/{requests}"})
        print(f"  HF padded generate: {seconds:.2f} s ({same}/{requests} rows identical to hf_paged)", flush=True)
        hf_rows = [padded[row, width:].tolist() for row in range(requests)]
        result["generate_batch_vs_padded_same"] = sum(a == b for a, b in zip(hf_tokens, hf_rows))
        result["divergences_vs_padded"] = explain_divergences(model, prompts, paged_tokens, hf_rows)
        print(f"  generate_batch vs padded: {result['generate_batch_vs_padded_same']}/{requests} identical; hf_paged "
              f"vs padded (row, step, fp32 gap, bf16 spacing): {result['divergences_vs_padded']}", flush=True)
    except Exception as e:  # noqa: BLE001
        result["rows"].append({"system": "HF generate (padded)", "error": f"{type(e).__name__}: {e}"[:500]})
        print(f"  HF padded generate FAILED: {e}", flush=True)
    finally:
        hf_paged.enable()


def engine_phases(model, prompts, max_tokens: int, outdir, **options) -> dict:
    """Where an engine step's time goes on the GPU, with and without decode graphs: each step timed phase by phase
    (schedule / block moves / forward + sampling / update, a synchronize after each), then torch.profiler over a few
    decode steps (its top operators by host and by device time go to OUTDIR/profile_<graphs>.txt)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import hf_paged

    params = hf_paged.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    options = {"block_size": 16, "max_num_seqs": 256, "max_num_batched_tokens": 8192, "kv_cache_memory": 16 * 2**30,
               "attention_backend": "auto", "enable_prefix_caching": False, **options}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)  # (a CPU dry run)
    result = {}
    for graphs in (True, False):
        llm = hf_paged.LLM(model, cuda_graphs=graphs, **options)
        engine = llm.engine
        llm.generate(prompts, hf_paged.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                     use_tqdm=False)  # warm-up: kernels built, the 64-row decode graph captured
        for prompt in prompts:
            engine.add_request(prompt, params)
        phases = {"prefill": [], "decode": []}
        while engine.has_unfinished:
            marks = [time.perf_counter()]
            plan = engine.scheduler.schedule()
            marks.append(time.perf_counter())
            engine.memory.apply(plan)
            sync()
            marks.append(time.perf_counter())
            outcome = engine.runner.run(plan, engine.sampler)
            sync()
            marks.append(time.perf_counter())
            engine.scheduler.update(plan, outcome)
            marks.append(time.perf_counter())
            kind = "decode" if all(n == 1 for n in plan.num_new_tokens) else "prefill"
            phases[kind].append([(b - a) * 1e3 for a, b in zip(marks, marks[1:])])
        names = ("schedule", "moves", "run", "update")
        summary = {kind: {"steps": len(rows), **{name: statistics.median(r[i] for r in rows) if rows else None
                                                 for i, name in enumerate(names)}}
                   for kind, rows in phases.items()}
        for prompt in prompts:
            engine.add_request(prompt, params)
        for _ in range(3):  # the prefill steps
            engine.step()
        sync()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=activities) as prof:
            for _ in range(5):
                engine.step()
            sync()
        while engine.has_unfinished:
            engine.step()
        averages = prof.key_averages()
        text = "\n\n".join(averages.table(sort_by=key, row_limit=25)
                           for key in ("self_cpu_time_total", "self_device_time_total"))
        (outdir / f"profile_graphs_{graphs}.txt").write_text(text)
        summary["graphs_state"] = engine.runner.graphs.stats() if engine.runner.graphs is not None else None
        result[f"graphs={graphs}"] = summary
        print(f"  graphs={graphs}: median ms per phase {summary}", flush=True)
        del llm, engine
        torch.cuda.empty_cache()
    return result


def llama_and_prompts(model_config: dict, requests: int):
    """gpu_check's random Llama (bf16, on the GPU) and its `requests` prompts of 128-512 random tokens (seed 0)."""
    import torch

    from hf_paged.tiny import tiny_model

    with torch.device("cuda"):
        model = tiny_model("llama", seed=0, sharpen=1.0, dtype=torch.bfloat16, **model_config)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, model_config["vocab_size"]) for _ in range(rng.randint(128, 512))]
               for _ in range(requests)]
    return model, prompts


def timed_generate(llm, prompts, params) -> tuple[float, list]:
    """Seconds of one `llm.generate` call, the device synchronized before and after, and its outputs."""
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - start, outputs


def profile(outdir, requests: int, model_config: dict) -> dict:
    """The engine's step on the ~1.1B Llama of gpu_check (bf16), phase by phase, graphs on and off."""
    model, prompts = llama_and_prompts(model_config, requests)
    return engine_phases(model, prompts, 32, outdir)
