"""The parity step of the GPU check (gpu_check.py): hf_paged's generate take-over vs HF generate on the GPU. It
borrows the test suite's helpers (tests/conftest.py of the source checkout this package runs from)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2] / "tests"


def suite_helpers():
    """tests/conftest.py of the checkout (loaded under its own name, not as `conftest`, so a pytest run in the same
    process keeps its own); a clear error from an installed package, which has no tests/."""
    path = TESTS / "conftest.py"
    if not path.is_file():
        raise RuntimeError(f"the GPU parity step needs the source checkout's tests/conftest.py (looked in {TESTS})")
    spec = importlib.util.spec_from_file_location("hf_paged_suite_conftest", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

PARITY_ARCHS = ("llama", "qwen3", "gemma2", "gpt2", "mixtral")


def parity(outdir: Path) -> dict:
    """generate(cache_implementation="paged") vs HF generate on one left-padded batch of 8 prompts (3-90 tokens),
    24 greedy tokens, per tiny architecture and dtype: identical rows, and for each row that differs HF's top-2 logit
    margin at the first differing token (a near tie, < 1e-3, is a rounding flip; a larger one is a real difference)."""
    import torch

    from hf_paged.tiny import tiny_model

    lengths = [5, 17, 40, 3, 64, 90, 33, 8]
    width = max(lengths)
    ids, mask = (t.cuda() for t in suite_helpers().left_padded_batch(lengths))
    options = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False)
    rows = []
    for arch in PARITY_ARCHS:
        for dtype in (torch.float32, torch.bfloat16):
            label = f"{arch} {str(dtype).split('.')[-1]}"
            try:
                model = tiny_model(arch, dtype=dtype).cuda()
                ref = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, output_logits=True,
                                     **options)
                out = model.generate(ids, attention_mask=mask, cache_implementation="paged", **options)
                margins = []
                for row in range(len(lengths)):
                    diff = (out[row] != ref.sequences[row]).nonzero()
                    if len(diff):
                        step = int(diff[0]) - width
                        top2 = ref.logits[step][row].float().topk(2).values
                        margins.append((step, float(top2[0] - top2[1])))
                rows.append({"case": label, "identical": f"{len(lengths) - len(margins)}/{len(lengths)}",
                             "first_divergence_step_margin": margins,
                             "max_margin": max((m for _, m in margins), default=None)})
                print(f"  {label:<16} identical {rows[-1]['identical']}  divergences (step, HF margin): {margins}",
                      flush=True)
            except Exception as e:  # noqa: BLE001
                rows.append({"case": label, "error": f"{type(e).__name__}: {e}"[:500]})
                print(f"  {label:<16} FAILED: {e}", flush=True)
    return {"rows": rows}


def explain_divergences(model, prompts, rows_a, rows_b, limit: int = 16) -> list:
    """For the first `limit` rows: where rows_a and rows_b part, the float32 gap between the two tokens chosen and
    the bf16 spacing of the top logit (tests/conftest.py's fp32_divergences)."""
    return suite_helpers().fp32_divergences(model, prompts[:limit], rows_a[:limit], rows_b[:limit])
