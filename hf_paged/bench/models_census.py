"""The model census: every causal-LM architecture transformers registers, built tiny, run greedy with and without
hf_paged.

    python -m hf_paged.bench.models_census                       # all (in a source checkout: writes docs/models.md
                                                                 # and benchmarks/results/models.json)
    python -m hf_paged.bench.models_census --only llama gpt2     # a few
    python -m hf_paged.bench.models_census --json out.json --markdown out.md   # the table of just these results

For each model type in transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES: its config class with only the sizes it
declares shrunk (hidden 64, 2 layers, 4 heads, 2 KV heads, intermediate 128, vocab 512, 256 positions), random
weights (seed 0), eval mode; a stack with layer types other than attention (linear-attention / state-space / conv
layers) or whose first 2 layers miss one of its layer types (sliding layers with a full one every k-th, ...) with the
fewest N >= 4 layers whose pattern (its config class's own, for N layers) holds every layer type of its full-size
default (census_layers.py; each result records its "layers" and "layer_types"); a left-padded batch of
two prompts (7 and 4 tokens), 8 new tokens, greedy, through HF `generate` and through
`generate(cache_implementation="paged")`. Outcomes:
  exact           paged tokens equal HF's
  exact (unpadded)  a row differs from HF's left-padded batch but equals HF generate on that prompt alone (models whose
                  positions HF counts from the padding: HF's batch, not the paged row, depends on the padding)
  near-tie        they differ only after a step where HF's own top-2 logit margin was < 1e-3
  refused         hf_paged raised ValueError (the reason is listed)
  WRONG           they differ elsewhere (silently wrong: the worst outcome a drop-in can have)
  CRASH           hf_paged raised something other than ValueError
  not buildable   the config class or model cannot be built tiny this way
  HF fails        HF's own generate fails on the tiny model
A second check per model (the PagedCache column): HF's own greedy `generate` loop on a caller-passed
`hf_paged.PagedCache(model.config)` (`generate(..., cache=PagedCache(config))`), the same inputs, compared token for
token with HF's default generate (its DynamicCache) above. Outcomes as above (no "exact (unpadded)": both runs are
HF's, padding included), plus:
  refused         PagedCache raised ValueError: a layer type it cannot hold (indexed / compressed sparse attention)
                  is refused when the cache is built (the reason is listed)
  HF rejects      HF's generate fails with a passed cache of the model's layer types: with
                  `dynamic_cache(config=model.config)` passed the same way it fails too (the PagedCache's error listed),
                  or the model's code leaves a passed cache unused (a passed DynamicCache stays empty too)
  WRONG / CRASH   as above; CRASH also when generate fails on the PagedCache but not on a passed DynamicCache
A model that is not buildable or whose HF generate fails has that outcome in both columns.
Each model runs in its own subprocess (a crash or a hang costs only that model; --timeout seconds each; one killed
before its result counts by the phase it had reached: only a death while hf_paged ran is a CRASH; the PagedCache check
runs before the engine's, so a death in it is re-run without it for the engine's column).
    python -m hf_paged.bench.models_census --only blt --update   # re-run a few into the last results; the table is
                                                                 # rewritten when those results cover every type
Outside a source checkout the defaults are hf-paged-bench-models.json and .md in the current folder.
"""
from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

from . import census_layers  # the layer count and pattern per model type
from .common import default_json, worker_env

ROOT = Path(__file__).resolve().parents[2]  # the source checkout this runs from, if it is one
CHECKOUT = (ROOT / "benchmarks" / "results").is_dir() and (ROOT / "docs").is_dir()

SIZES = {"hidden_size": 64, "n_embd": 64, "d_model": 64, "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2,
         "num_attention_heads": 4, "n_head": 4, "attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "ffn_dim": 128, "n_inner": 128, "vocab_size": 512, "head_dim": 16,
         "max_position_embeddings": 256, "n_positions": 256,
         # encoder-decoder families' decoders (their *ForCausalLM is decoder-only)
         "decoder_layers": 2, "encoder_layers": 2, "decoder_attention_heads": 4, "encoder_attention_heads": 4,
         "decoder_ffn_dim": 128, "encoder_ffn_dim": 128,
         # partial rotary and multi-head latent attention sizes that must fit the shrunk heads
         "rotary_dim": 8, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 32, "kv_lora_rank": 32,
         "q_lora_rank": 32, "hidden_size_global": 64, "encoder_hash_byte_group_vocab": 512,
         # state-space / linear-attention layers: head counts x head sizes that fit the shrunk hidden size (2 x 64)
         "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_ssm": 128, "mamba_num_heads": 8, "mamba_head_dim": 16,
         "mamba_headdim": 16, "mamba_dt_rank": 4, "adapter_rank": 8, "linear_num_heads": 4, "linear_head_dim": 16}
# sizes whose names other types use for something else, or that a config derives from its full-size hidden size
ZAMBA = {"attention_hidden_size": 128, "attention_head_dim": 32}  # 2 x hidden, split over the 4 heads
# recurrent_gemma: its recurrent block's convolution state is sized by hidden_size but holds lru_width channels (equal
# at full size); left at 2560, HF's own generate fails on a 1-token prompt, and so does the engine's start-up check
TYPE_SIZES = {"mamba2": {"num_heads": 8}, "rwkv": {"attention_hidden_size": 64}, "zamba": ZAMBA, "zamba2": ZAMBA,
              "recurrent_gemma": {"lru_width": 64}}
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "decoder_layers", "encoder_layers")
SUB_CONFIGS = ("encoder_config", "decoder_config", "global_config", "patcher_config")  # blt's, shrunk like the rest
MARGIN = 1e-3
TRIES = 3  # layer counts tried for a stack that cannot be built with the fewest (census_layers.plans)


def model_types() -> list[str]:
    from hf_paged.tiny import causal_lm_types

    return causal_lm_types()


def tiny(model_type: str, sizes: dict | None = None):
    """The model type built tiny (see the module doc): with the first layer count of `census_layers.plans` it can
    be built with (of the first TRIES). `sizes`: other sizes than SIZES (the same names; `bench archs`)."""
    import torch

    from hf_paged.tiny import config_of, model_from_config

    def build(layers: int, pattern):
        config = config_of(model_type, **census_layers.REPRESENTATIVE.get(model_type, {}))
        text = config.get_text_config(decoder=True)
        shrink(config, layers, sizes)
        if text is not config:
            shrink(text, layers, sizes)
        census_layers.adopt(text, pattern)
        for name, value in TYPE_SIZES.get(model_type, {}).items():
            setattr(text, name, value)
        for holder in {id(config): config, id(text): text}.values():
            for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
                if getattr(holder, name, None) is not None:
                    setattr(holder, name, {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}[name])
        torch.manual_seed(0)
        return model_from_config(config)

    full = config_of(model_type, **census_layers.REPRESENTATIVE.get(model_type, {}))
    first = None
    for layers, pattern in itertools.islice(census_layers.plans(full.get_text_config(decoder=True)), TRIES):
        try:
            return build(layers, pattern)
        except Exception as e:  # noqa: BLE001
            first = first or e
    raise first


def shrink(config, layers: int = 2, sizes: dict | None = None) -> None:
    """Set each size of SIZES that the config declares (not None), its layer counts to `layers`, and in its
    SUB_CONFIGS (2 layers; the text config is shrunk by the caller; vision / audio towers are left as they are);
    sizes it cannot take (read-only properties, per-layer attributes) are left as they are."""
    for name, value in (SIZES if sizes is None else sizes).items():
        try:
            if getattr(config, name, None) is not None:
                setattr(config, name, layers if name in LAYER_COUNTS else value)
        except (AttributeError, NotImplementedError, ValueError, TypeError):
            pass
    try:  # multi-head latent attention expands its K/V to every query head: as many K/V heads as query heads
        if getattr(config, "kv_lora_rank", None) and getattr(config, "num_key_value_heads", None):
            config.num_key_value_heads = config.num_attention_heads
    except Exception:  # noqa: BLE001  (a per-layer attribute of a heterogeneous config refuses a global read)
        pass
    for name in SUB_CONFIGS:
        if getattr(config, name, None) is not None:
            shrink(getattr(config, name), sizes=sizes)


def run_one(model_type: str, phase=lambda name: None, cache_check: bool = True, report=lambda part: None) -> dict:
    """The outcome of one model type (see the module doc): the engine's in "outcome" / "reason", the PagedCache
    check's in "paged_cache" (absent with cache_check=False), the layers built in "layers" / "layer_types".
    `phase(name)` is told "build", "hf", "cache" and "paged" as each starts, so that a run killed midway can still
    be classified; `report` gets each part of the result as soon as it is known ({"layers": ...} once built,
    {"paged_cache": ...} once checked)."""
    import torch
    import hf_paged  # noqa: F401  (the take-over)

    phase("build")
    try:
        model = tiny(model_type)
    except Exception as e:  # noqa: BLE001
        return both({"outcome": "not buildable", "reason": f"{type(e).__name__}: {e}"[:300]}, cache_check)
    layers = census_layers.described(model.config.get_text_config(decoder=True))
    report(layers)
    vocab = min(model.config.get_text_config(decoder=True).vocab_size or 512, 512)
    gen = torch.Generator().manual_seed(1)
    ids = torch.zeros(2, 7, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate((7, 4)):
        ids[row, 7 - length:] = torch.randint(3, vocab, (length,), generator=gen)
        mask[row, 7 - length:] = 1
    options = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    phase("hf")
    try:
        ref = model.generate(ids, return_dict_in_generate=True, output_logits=True, **options)
    except Exception as e:  # noqa: BLE001
        return {**both({"outcome": "HF fails", "reason": f"{type(e).__name__}: {e}"[:300]}, cache_check), **layers}
    cache = None
    if cache_check:
        phase("cache")
        cache = check_paged_cache(model, ids, options, ref)
        report({"paged_cache": cache})
    phase("paged")
    result = {**check_engine(model, ids, mask, options, ref), **layers}
    return result if cache is None else {**result, "paged_cache": cache}


def both(result: dict, cache_check: bool) -> dict:
    """A result that stands for both columns (the model did not build, or HF's own generate failed)."""
    return {**result, "paged_cache": dict(result)} if cache_check else result


def check_engine(model, ids, mask, options, ref) -> dict:
    """`generate(cache_implementation="paged")` against HF's generate."""
    try:
        out = model.generate(ids, cache_implementation="paged", **options)
    except ValueError as e:
        return {"outcome": "refused", "reason": str(e)[:300]}
    except Exception as e:  # noqa: BLE001
        return {"outcome": "CRASH", "reason": f"{type(e).__name__}: {e}"[:300]}
    return compare(out, ref, ids.shape[1], lambda row: same_as_hf_alone(model, ids[row], mask[row], out[row], options))


def check_paged_cache(model, ids, options, ref) -> dict:
    """HF's own generate on a passed `hf_paged.PagedCache` against HF's generate on its DynamicCache."""
    import traceback

    import hf_paged
    from hf_paged.tiny import dynamic_cache

    try:
        cache = hf_paged.PagedCache(model.config)
    except ValueError as e:
        return {"outcome": "refused", "reason": str(e)[:300]}
    except Exception as e:  # noqa: BLE001
        return {"outcome": "CRASH", "reason": f"PagedCache(config): {type(e).__name__}: {e}"[:300]}
    try:
        out = model.generate(ids, cache=cache, **options)
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
        try:
            model.generate(ids, cache=dynamic_cache(config=model.config), **options)
        except Exception:  # noqa: BLE001
            return {"outcome": "HF rejects", "reason": error[:300]}
        where = traceback.extract_tb(e.__traceback__)[-1]
        ours = "hf_paged" in Path(where.filename).parts
        if isinstance(e, ValueError) and ours:
            return {"outcome": "refused", "reason": str(e)[:300]}
        return {"outcome": "CRASH", "reason": f"{error} (at {Path(where.filename).name}:{where.lineno}; a passed "
                                              f"DynamicCache works)"[:300]}
    result = compare(out, ref, ids.shape[1])
    if cache.get_seq_length() == 0:  # not used: by HF's design when a passed DynamicCache stays empty too
        control = dynamic_cache(config=model.config)
        model.generate(ids, cache=control, **options)
        if control.get_seq_length() == 0:
            return {"outcome": "HF rejects", "reason": f"the model's code does not use a passed cache (left empty; "
                                                       f"tokens {result['outcome']})"}
        return {"outcome": "WRONG", "reason": "generate left the PagedCache empty but writes a passed DynamicCache"}
    return result


def compare(out, ref, prompt_len: int, alone=None) -> dict:
    """Tokens `out` against HF's `ref` (sequences and logits): exact, near-tie or WRONG; with `alone(row)` (the
    engine's check), a differing row equal to HF generate on that prompt alone is "exact (unpadded)"."""
    if out.shape == ref.sequences.shape and bool((out == ref.sequences).all()):
        return {"outcome": "exact"}
    if out.shape != ref.sequences.shape:
        return {"outcome": "WRONG", "reason": f"shape {tuple(out.shape)} vs HF {tuple(ref.sequences.shape)}"}
    unpadded, ties = [], []
    for row in range(out.shape[0]):
        diff = (out[row] != ref.sequences[row]).nonzero()
        if len(diff):
            if alone is not None and alone(row):
                unpadded.append(row)
                continue
            step = int(diff[0]) - prompt_len
            if step < 0:
                return {"outcome": "WRONG", "reason": f"row {row} differs in the prompt at {int(diff[0])}"}
            top2 = ref.logits[step][row].topk(2).values
            margin = float(top2[0] - top2[1])
            if margin >= MARGIN:
                return {"outcome": "WRONG", "reason": f"row {row} differs at new token {step} (HF margin {margin:.3g})"}
            ties.append(row)
    if ties:
        return {"outcome": "near-tie", "reason": f"rows {ties} differ only after an HF top-2 margin < {MARGIN}"}
    return {"outcome": "exact (unpadded)", "reason": f"rows {unpadded} equal HF run on that prompt alone; HF's own "
                                                     f"left-padded batch differs there (its positions count the padding)"}


def same_as_hf_alone(model, ids, mask, got, options) -> bool:
    """Whether paged row `got` equals HF generate on that row's prompt without padding."""
    length = int(mask.sum())
    alone_options = {**options, "attention_mask": mask[None, -length:]}
    alone = model.generate(ids[None, -length:], **alone_options)[0]
    return bool((alone == got[-alone.shape[0]:]).all())


def markdown(results: dict[str, dict]) -> str:
    from hf_paged.tiny import transformers_version

    def totals(outcomes) -> str:
        counts: dict[str, int] = {}
        for outcome in outcomes:
            counts[outcome] = counts.get(outcome, 0) + 1
        return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))

    cache = {name: r.get("paged_cache", {"outcome": "not run"}) for name, r in results.items()}
    lines = ["# Models", "",
             f"Every causal-LM type of transformers {transformers_version()}, built tiny from its own config class "
             "and run greedy on a left-padded batch of two with HF `generate` and with "
             "`generate(cache_implementation=\"paged\")`. The PagedCache column runs HF's own `generate` loop on a "
             "passed `hf_paged.PagedCache` (`generate(..., cache=PagedCache(model.config))`) and compares it token for "
             "token with HF's `generate` on its DynamicCache. Made by `python -m hf_paged.bench.models_census` (see its docstring "
             "for the method and the outcomes).", "",
             f"Totals: paged engine: {totals(r['outcome'] for r in results.values())}; "
             f"PagedCache: {totals(r['outcome'] for r in cache.values())}", "",
             "| model type | outcome | reason | PagedCache |", "|---|---|---|---|"]
    for name, r in sorted(results.items()):
        reason = clean(r.get("reason", ""))
        c = cache[name]
        column = c["outcome"] if clean(c.get("reason", "")) in ("", reason) else f"{c['outcome']}: {clean(c['reason'])}"
        lines.append(f"| {name} | {r['outcome']} | {reason} | {column} |")
    return "\n".join(lines + families(results, totals)) + "\n"


def families(results: dict[str, dict], totals) -> list[str]:
    """The table's second part: the model types grouped by the layer types they were built with (their first
    per-layer list, usually `layer_types`), each with its layer count and the outcomes of the group."""
    groups: dict[str, list[str]] = {}
    for name, r in results.items():
        lists = r.get("layer_types") or {}
        kinds = sorted(set(next(iter(lists.values()), ()))) if "layers" in r else \
            ["(not built)" if r["outcome"] == "not buildable" else "(layers not recorded)"]
        groups.setdefault(", ".join(kinds) or "(no layer pattern)", []).append(name)
    lines = ["", "## By layer types", "",
             "Each model type is built with 2 layers, or with the fewest N >= 4 that hold every layer type of its "
             "full-size config's pattern (hf_paged/bench/census_layers.py); the number after each name is its N.", "",
             "| layer types | model types (layers) | paged engine | PagedCache |", "|---|---|---|---|"]
    for kinds, names in sorted(groups.items(), key=lambda item: (-len(item[1]), item[0])):
        members = ", ".join(f"{n} ({results[n]['layers']})" if "layers" in results[n] else n for n in sorted(names))
        cache = (results[n].get("paged_cache", {"outcome": "not run"})["outcome"] for n in names)
        lines.append(f"| {kinds} | {members} | {totals(results[n]['outcome'] for n in names)} | {totals(cache)} |")
    return lines


def clean(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


# a worker that died before printing its result: what the phase it was in means
UNFINISHED = {"build": ("not buildable", "building it tiny"), "hf": ("HF fails", "HF's own generate"),
              "cache": ("CRASH", "HF's generate on a PagedCache"), "paged": ("CRASH", "the paged generate")}


def run_worker(name: str, timeout: float, cache_check: bool = True) -> dict:
    """Run one model type in its own process; a crash or hang costs only that one. Killed or timed out before
    its result, it is classified by the phase it had reached (a crash only when hf_paged was running); one that
    died in the PagedCache check is run again without it for the engine's outcome."""
    command = [sys.executable, "-m", "hf_paged.bench.models_census", "--worker", name]
    command += [] if cache_check else ["--no-cache-check"]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=worker_env())
        stdout, why = proc.stdout, f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"
    except subprocess.TimeoutExpired as e:
        stdout, why = e.stdout or "", f"timed out after {timeout:.0f} s"
        stdout = stdout.decode(errors="replace") if isinstance(stdout, bytes) else stdout
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    if lines and "outcome" in lines[-1]:
        return lines[-1]
    reached = ([line["phase"] for line in lines if "phase" in line] or ["build"])[-1]
    outcome, doing = UNFINISHED[reached]
    result = {"outcome": outcome, "reason": f"{why} (during {doing})"}
    parts = {k: v for line in lines if "phase" not in line for k, v in line.items()}  # what was reported
    if reached == "cache":
        return {**run_worker(name, timeout, cache_check=False), "paged_cache": result}
    if reached in ("build", "hf"):
        return {**both(result, cache_check), **{k: v for k, v in parts.items() if k != "paged_cache"}}
    return {**parts, **result}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", help="model types to run (default: all)")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "models.json") if CHECKOUT
                        else default_json("models"), help="where the results go (JSON; default: %(default)s)")
    parser.add_argument("--update", action="store_true",
                        help="merge into the results already in --json (the table is written once they cover all)")
    parser.add_argument("--markdown", help="the table (markdown), written for the results at hand (default: "
                                           "docs/models.md in a source checkout, else the JSON's path ending .md; "
                                           "written once the results cover every type)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per model")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--no-cache-check", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        result = run_one(args.worker, lambda name: print(json.dumps({"phase": name}), flush=True),
                         cache_check=not args.no_cache_check,
                         report=lambda part: print(json.dumps(part), flush=True))
        print(json.dumps(result))
        return 0
    results = json.loads(Path(args.json).read_text()) if args.update else {}
    for name in args.only or model_types():
        start = time.perf_counter()
        result = results[name] = run_worker(name, args.timeout)
        cache = result.get("paged_cache", {})
        print(f"{name:28s} {result['outcome']:14s} {cache.get('outcome', '-'):14s} {time.perf_counter() - start:5.1f}s "
              f"{result.get('reason', '')[:80]} / {cache.get('reason', '')[:80]}", flush=True)
    Path(args.json).write_text(json.dumps(results, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(markdown(results))
    elif set(model_types()) <= set(results):  # a complete census
        table = ROOT / "docs" / "models.md" if CHECKOUT else Path(args.json).with_suffix(".md")
        table.write_text(markdown({n: results[n] for n in model_types()}))
    bad = [n for n, r in results.items() if r["outcome"] in ("WRONG", "CRASH")]
    bad_cache = [n for n, r in results.items() if r.get("paged_cache", {}).get("outcome") in ("WRONG", "CRASH")]
    print(f"{len(results)} model types; silently wrong or crashed: {bad or 'none'}; "
          f"on a PagedCache: {bad_cache or 'none'}")
    bad += bad_cache
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
