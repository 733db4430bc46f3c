"""The model census: every causal-LM architecture transformers registers, built tiny, run greedy with and without
hf_paged.

    python benchmarks/models.py                       # all; writes docs/models.md and a JSON next to --json
    python benchmarks/models.py --only llama gpt2     # a few
    python benchmarks/models.py --json out.json --markdown out.md

For each model type in transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES: its config class with only the sizes it
declares shrunk (hidden 64, 2 layers, 4 heads, 2 KV heads, intermediate 128, vocab 512, 256 positions), random
weights (seed 0), eval mode; a left-padded batch of two prompts (7 and 4 tokens), 8 new tokens, greedy, through HF
`generate` and through `generate(cache_implementation="paged")`. Outcomes:
  exact           paged tokens equal HF's
  near-tie        they differ only after a step where HF's own top-2 logit margin was < 1e-3
  refused         hf_paged raised ValueError (the reason is listed)
  WRONG           they differ elsewhere (silently wrong: the worst outcome a drop-in can have)
  CRASH           hf_paged raised something other than ValueError
  not buildable   the config class or model cannot be built tiny this way
  HF fails        HF's own generate fails on the tiny model
Each model runs in its own subprocess (a crash or a hang costs only that model; --timeout seconds each).
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
         "max_position_embeddings": 256, "n_positions": 256}
MARGIN = 1e-3


def model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny(model_type: str):
    import torch
    import transformers as tf
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type]()
    for name, value in SIZES.items():
        if getattr(config, name, None) is not None:
            setattr(config, name, value)
    text = config.get_text_config(decoder=True)
    if text is not config:
        for name, value in SIZES.items():
            if getattr(text, name, None) is not None:
                setattr(text, name, value)
    for holder in {id(config): config, id(text): text}.values():
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if getattr(holder, name, None) is not None:
                setattr(holder, name, {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}[name])
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    return model


def run_one(model_type: str) -> dict:
    import torch
    import hf_paged  # noqa: F401  (the take-over)

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
    try:
        ref = model.generate(ids, return_dict_in_generate=True, output_logits=True, **options)
    except Exception as e:  # noqa: BLE001
        return {"outcome": "HF fails", "reason": f"{type(e).__name__}: {e}"[:300]}
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
    for row in range(out.shape[0]):
        diff = (out[row] != ref.sequences[row]).nonzero()
        if len(diff):
            step = int(diff[0]) - ids.shape[1]
            top2 = ref.logits[step][row].topk(2).values
            margin = float(top2[0] - top2[1])
            if step < 0 or margin >= MARGIN:
                return {"outcome": "WRONG", "reason": f"row {row} differs at new token {step} (HF margin {margin:.3g})"}
    return {"outcome": "near-tie", "reason": f"differs only after an HF top-2 margin < {MARGIN}"}


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", help="model types to run (default: all)")
    parser.add_argument("--json", default="models.json", help="where the results go (JSON)")
    parser.add_argument("--markdown", default=str(ROOT / "docs" / "models.md"), help="the table (markdown)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per model")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(run_one(args.worker)))
        return 0
    results = {}
    for name in args.only or model_types():
        start = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, __file__, "--worker", name], capture_output=True, text=True,
                                  timeout=args.timeout, cwd=ROOT)
            last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
            result = json.loads(last) if last.startswith("{") else {
                "outcome": "CRASH", "reason": f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"}
        except subprocess.TimeoutExpired:
            result = {"outcome": "CRASH", "reason": f"timed out after {args.timeout:.0f} s"}
        results[name] = result
        print(f"{name:28s} {result['outcome']:14s} {time.perf_counter() - start:5.1f}s {result.get('reason', '')[:100]}",
              flush=True)
    Path(args.json).write_text(json.dumps(results, indent=1))
    if not args.only:
        Path(args.markdown).write_text(markdown(results))
    bad = [n for n, r in results.items() if r["outcome"] in ("WRONG", "CRASH")]
    print(f"{len(results)} model types; silently wrong or crashed: {bad or 'none'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
