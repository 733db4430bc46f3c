"""The model census: every causal-LM architecture transformers registers, built tiny, run greedy with and without
hf_paged.

    python benchmarks/models.py                       # all; writes docs/models.md and benchmarks/results/models.json
    python benchmarks/models.py --only llama gpt2     # a few
    python benchmarks/models.py --json out.json --markdown out.md

For each model type in transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES: its config class with only the sizes it
declares shrunk (hidden 64, 2 layers, 4 heads, 2 KV heads, intermediate 128, vocab 512, 256 positions), random
weights (seed 0), eval mode; a left-padded batch of two prompts (7 and 4 tokens), 8 new tokens, greedy, through HF
`generate` and through `generate(cache_implementation="paged")`. Outcomes:
  exact           paged tokens equal HF's
  exact (unpadded)  a row differs from HF's left-padded batch but equals HF generate on that prompt alone (models whose
                  positions HF counts from the padding: HF's batch, not the paged row, depends on the padding)
  near-tie        they differ only after a step where HF's own top-2 logit margin was < 1e-3
  refused         hf_paged raised ValueError (the reason is listed)
  WRONG           they differ elsewhere (silently wrong: the worst outcome a drop-in can have)
  CRASH           hf_paged raised something other than ValueError
  not buildable   the config class or model cannot be built tiny this way
  HF fails        HF's own generate fails on the tiny model
Each model runs in its own subprocess (a crash or a hang costs only that model; --timeout seconds each; one killed
before its result counts by the phase it had reached: only a death while hf_paged ran is a CRASH).
    python benchmarks/models.py --only blt --update   # re-run a few into the last results; the table is rewritten
                                                      # when those results cover every type
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = {"hidden_size": 64, "n_embd": 64, "d_model": 64, "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2,
         "num_attention_heads": 4, "n_head": 4, "attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "ffn_dim": 128, "n_inner": 128, "vocab_size": 512, "head_dim": 16,
         "max_position_embeddings": 256, "n_positions": 256,
         # encoder-decoder families' decoders (their *ForCausalLM is decoder-only)
         "decoder_layers": 2, "encoder_layers": 2, "decoder_attention_heads": 4, "encoder_attention_heads": 4,
         "decoder_ffn_dim": 128, "encoder_ffn_dim": 128,
         # partial rotary and multi-head latent attention sizes that must fit the shrunk heads
         "rotary_dim": 8, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 32, "kv_lora_rank": 32,
         "q_lora_rank": 32, "hidden_size_global": 64, "encoder_hash_byte_group_vocab": 512}
SUB_CONFIGS = ("encoder_config", "decoder_config", "global_config", "patcher_config")  # blt's, shrunk like the rest
MARGIN = 1e-3


def model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny(model_type: str):
    import torch
    import transformers as tf
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type]()
    shrink(config)
    text = config.get_text_config(decoder=True)
    if text is not config:
        shrink(text)
    for holder in {id(config): config, id(text): text}.values():
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if getattr(holder, name, None) is not None:
                setattr(holder, name, {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}[name])
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    return model


def shrink(config) -> None:
    """Set each size of SIZES that the config declares (not None), and in its SUB_CONFIGS (the text config is
    shrunk by the caller; vision / audio towers are left as they are); sizes it cannot take (read-only properties,
    per-layer attributes) are left as they are."""
    for name, value in SIZES.items():
        try:
            if getattr(config, name, None) is not None:
                setattr(config, name, value)
        except (AttributeError, NotImplementedError, ValueError, TypeError):
            pass
    for name in SUB_CONFIGS:
        if getattr(config, name, None) is not None:
            shrink(getattr(config, name))


def run_one(model_type: str, phase=lambda name: None) -> dict:
    """The outcome of one model type (see the module doc). `phase(name)` is told "build", "hf" and "paged" as each
    starts, so that a run killed midway can still be classified."""
    import torch
    import hf_paged  # noqa: F401  (the take-over)

    phase("build")
    try:
        model = tiny(model_type)
    except Exception as e:  # noqa: BLE001
        return {"outcome": "not buildable", "reason": f"{type(e).__name__}: {e}"[:300]}
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
        return {"outcome": "HF fails", "reason": f"{type(e).__name__}: {e}"[:300]}
    phase("paged")
    try:
        out = model.generate(ids, cache_implementation="paged", **options)
    except ValueError as e:
        return {"outcome": "refused", "reason": str(e)[:300]}
    except Exception as e:  # noqa: BLE001
        return {"outcome": "CRASH", "reason": f"{type(e).__name__}: {e}"[:300]}
    if out.shape == ref.sequences.shape and bool((out == ref.sequences).all()):
        return {"outcome": "exact"}
    if out.shape != ref.sequences.shape:
        return {"outcome": "WRONG", "reason": f"shape {tuple(out.shape)} vs HF {tuple(ref.sequences.shape)}"}
    unpadded, ties = [], []
    for row in range(out.shape[0]):
        diff = (out[row] != ref.sequences[row]).nonzero()
        if len(diff):
            if same_as_hf_alone(model, ids[row], mask[row], out[row], options):
                unpadded.append(row)
                continue
            step = int(diff[0]) - ids.shape[1]
            top2 = ref.logits[step][row].topk(2).values
            margin = float(top2[0] - top2[1])
            if step < 0 or margin >= MARGIN:
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
    counts: dict[str, int] = {}
    for r in results.values():
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    import transformers

    lines = ["# Models", "",
             f"Every causal-LM type of transformers {transformers.__version__}, built tiny from its own config class "
             "and run greedy on a left-padded batch of two with HF `generate` and with "
             "`generate(cache_implementation=\"paged\")`. Made by `python benchmarks/models.py` (see its docstring "
             "for the method and the outcomes).", "",
             "Totals: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), "",
             "| model type | outcome | reason |", "|---|---|---|"]
    for name, r in sorted(results.items()):
        reason = r.get("reason", "").replace("|", "/").replace("\n", " ")
        lines.append(f"| {name} | {r['outcome']} | {reason} |")
    return "\n".join(lines) + "\n"


# a worker that died before printing its result: what the phase it was in means
UNFINISHED = {"build": ("not buildable", "building it tiny"), "hf": ("HF fails", "HF's own generate"),
              "paged": ("CRASH", "the paged generate")}


def run_worker(name: str, timeout: float) -> dict:
    """Run one model type in its own process; a crash or hang costs only that one. Killed or timed out before
    its result, it is classified by the phase it had reached (a crash only when hf_paged was running)."""
    try:
        proc = subprocess.run([sys.executable, __file__, "--worker", name], capture_output=True, text=True,
                              timeout=timeout, cwd=ROOT)
        stdout, why = proc.stdout, f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"
    except subprocess.TimeoutExpired as e:
        stdout, why = e.stdout or "", f"timed out after {timeout:.0f} s"
        stdout = stdout.decode(errors="replace") if isinstance(stdout, bytes) else stdout
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    if lines and "outcome" in lines[-1]:
        return lines[-1]
    reached = lines[-1]["phase"] if lines else "build"
    outcome, doing = UNFINISHED[reached]
    return {"outcome": outcome, "reason": f"{why} (during {doing})"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", help="model types to run (default: all)")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "models.json"),
                        help="where the results go (JSON)")
    parser.add_argument("--update", action="store_true",
                        help="merge into the results already in --json (the table is written once they cover all)")
    parser.add_argument("--markdown", default=str(ROOT / "docs" / "models.md"), help="the table (markdown)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per model")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = run_one(args.worker, lambda name: print(json.dumps({"phase": name}), flush=True))
        print(json.dumps(result))
        return 0
    results = json.loads(Path(args.json).read_text()) if args.update else {}
    for name in args.only or model_types():
        start = time.perf_counter()
        result = results[name] = run_worker(name, args.timeout)
        print(f"{name:28s} {result['outcome']:14s} {time.perf_counter() - start:5.1f}s {result.get('reason', '')[:100]}",
              flush=True)
    Path(args.json).write_text(json.dumps(results, indent=1))
    if set(model_types()) <= set(results):  # a complete census
        Path(args.markdown).write_text(markdown({n: results[n] for n in model_types()}))
    bad = [n for n, r in results.items() if r["outcome"] in ("WRONG", "CRASH")]
    print(f"{len(results)} model types; silently wrong or crashed: {bad or 'none'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
