"""Before an engine serves a model: one small check that its paged forward reproduces the model's own.

Two random sequences run through the engine's path (packed prefill, then one decode step each) on a throwaway
KV cache of a few blocks, and through the model's own forward with its own attention implementation. Logits must
agree to within float rounding; otherwise the model is refused with a ValueError that says so. This catches what
no list of features can (a module that does something to attention the paged function cannot see), and the
guard in `paged_forward.check_supported` turns any argument the paged function would ignore into an error here,
at start, instead of in the middle of serving. The verdict is kept on the model per (backend, dtype).

It also reports the one sliding window every layer's attention applied in that forward, if there is one: then no
query ever reads a slot more than a window behind it, and the engine may give those blocks back.
"""
from __future__ import annotations

import dataclasses
import inspect

import torch

from ..attention import AttentionBackends, AttentionMetadata
from ..kv import KVCache
from .forward_lock import forward_lock
from .paged_forward import PagedForwardContext, UnsupportedAttention, paged_attention_active
from .spec import ModelSpec

LENGTHS = (11, 5)  # two sequences of different lengths, longer than a block
BLOCK_SIZE = 4
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}  # relative to the largest logit; half precision: 3e-2


def _paged_logits(model, spec: ModelSpec, backends: AttentionBackends, sequences: list[list[int]]) -> tuple:
    """Prefill every sequence but its last token in one packed step, then decode that token for each: the last
    logits of each sequence from both steps, and the sliding window every attention call passed (None if they
    differ or pass none)."""
    device = spec.kv.device
    blocks_per_sequence = -(-max(map(len, sequences)) // BLOCK_SIZE)
    dtype = next(model.parameters()).dtype  # the model's own dtype, also when the engine's cache is fp8
    cache = KVCache(dataclasses.replace(spec.kv, dtype=dtype), 1 + blocks_per_sequence * len(sequences), BLOCK_SIZE)
    cache.storage.zero_()
    tables = [[1 + i * blocks_per_sequence + b for b in range(blocks_per_sequence)] for i in range(len(sequences))]
    results = []
    for start, end in (("prefill", -1), ("decode", None)):
        ids, positions, slots, query_lens, context_lens = [], [], [], [], []
        for seq, table in zip(sequences, tables):
            first = 0 if start == "prefill" else len(seq) - 1
            last = len(seq) - 1 if end == -1 else len(seq)
            ids += seq[first:last]
            positions += list(range(first, last))
            slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(first, last)]
            query_lens.append(last - first)
            context_lens.append(last)
        metadata = AttentionMetadata.build(query_lens, context_lens, tables, slots, BLOCK_SIZE, device)
        context = PagedForwardContext(metadata, cache, backends, windows=[])
        with paged_attention_active(spec.configs):
            out = model(input_ids=torch.tensor([ids], device=device), position_ids=torch.tensor([positions], device=device),
                        use_cache=False, paged_context=context)
        if context.num_calls != spec.kv.num_layers:
            model_type = getattr(model.config, "model_type", type(model).__name__)
            if context.num_calls > spec.kv.num_layers:
                raise UnsupportedAttention(f"model type {model_type!r}: its {spec.kv.num_layers} layers call attention "
                                           f"{context.num_calls} times per forward (e.g. differential attention); the "
                                           f"paged cache holds one K/V per layer")
            raise UnsupportedAttention(f"model type {model_type!r}: {context.num_calls} of its {spec.kv.num_layers} "
                                       f"layers route attention through transformers' AttentionInterface, so its KV "
                                       f"cache cannot be paged")
        rows = torch.tensor(query_lens, device=device).cumsum(0) - 1
        results.append(out.logits[0, rows].float())
    windows = set(context.windows)  # of the decode forward (every layer ran once)
    window = windows.pop() if len(windows) == 1 else None
    valid = isinstance(window, int) and not isinstance(window, bool) and window > 0
    return results, window if valid else None


def _own_logits(model, ids: list[int], device) -> torch.Tensor:
    """The model's own last logits for `ids`, called as HF generate calls it: with position ids 0.. when its forward
    takes them (roberta-like models would otherwise derive positions from their padding index)."""
    kwargs = {}
    if "position_ids" in inspect.signature(model.forward).parameters:
        kwargs["position_ids"] = torch.arange(len(ids), device=device)[None]
    return model(input_ids=torch.tensor([ids], device=device), **kwargs).logits[0, -1].float()


def _relative_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| relative to the largest finite |want|. Entries non-finite in both count as equal (a
    model whose weights already give NaN for some token is no reason to refuse it); NaN in one only is a mismatch."""
    both = ~torch.isfinite(got) & ~torch.isfinite(want)
    diff = torch.where(both, torch.zeros_like(got), (got - want).abs())
    finite = want[torch.isfinite(want)]
    scale = float(finite.abs().max()) if finite.numel() else 1.0
    return float(diff.max()) / max(scale, 1e-6)


def _window_fields(config) -> tuple:
    """What the config says of windows (attention modules read it on every forward): a change checks again."""
    text = config.get_text_config(decoder=True)
    return tuple(repr(getattr(text, name, None)) for name in ("sliding_window", "layer_types", "use_sliding_window",
                                                              "max_window_layers", "attention_chunk_size"))


@torch.inference_mode()
def check_paged_matches_model(model, spec: ModelSpec, backends: AttentionBackends) -> int | None:
    """Raise ValueError when the paged forward does not reproduce the model's own logits (see the module doc).
    Returns the sliding window every layer applies, or None."""
    dtype = next(model.parameters()).dtype
    key = (backends.name, str(dtype), str(spec.kv.device), _window_fields(model.config))
    verdicts = model.__dict__.setdefault("_hf_paged_probe", {})
    windows = model.__dict__.setdefault("_hf_paged_window", {})
    if key in verdicts:
        if verdicts[key] is not None:
            raise ValueError(verdicts[key])
        return windows.get(key)
    model_type = getattr(model.config, "model_type", type(model).__name__)
    generator = torch.Generator().manual_seed(0)
    vocab = min(spec.vocab_size, 1000)
    sequences = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in LENGTHS]
    with forward_lock(model):
        try:
            paged, window = _paged_logits(model, spec, backends, sequences)
        except UnsupportedAttention as e:
            verdicts[key] = str(e)
            raise ValueError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - a failing paged path refuses the model, with the cause; not kept
            # as the model's verdict: the failure may be passing (the next engine checks again)
            raise ValueError(f"model type {model_type!r}: its forward fails on hf_paged's paged path "
                             f"({type(e).__name__}: {e})") from e
        own = [[_own_logits(model, seq[:cut], spec.kv.device) for seq in sequences] for cut in (-1, None)]
    worst = 0.0
    for got, want in zip(paged, own):
        worst = max(worst, _relative_difference(got, torch.stack(want)))
    tolerance = TOLERANCE.get(dtype, 3e-2)
    verdicts[key] = None
    if not worst <= tolerance:  # also catches NaN
        verdicts[key] = (f"model type {model_type!r}: hf_paged's paged attention does not reproduce the model's own "
                         f"attention (largest logit difference {worst:.2e} of the largest logit, tolerance "
                         f"{tolerance:.0e}); it is refused rather than served wrong")
        raise ValueError(verdicts[key])
    windows[key] = window
    return window
