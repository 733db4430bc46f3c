"""Before an engine serves a model: one small check that its paged forward reproduces the model's own.

Three random sequences run through the engine's path on a throwaway KV cache of a few blocks, in packed steps as
serving makes them (`STEPS`: a prefill, a chunk of several tokens after cached context, decodes, all mixed in one
step), and through the model's own forward with its own attention implementation; the last logits of each sequence
at each step must agree to within float rounding; otherwise the model is refused with a ValueError that says so.
Position handling that is right only for a prefill from position 0 or for a single-token decode is caught here
(a position-embedding module that counts from the step or from a cache length), and so is a state layer that is
right only for a prefill and for single tokens: state models too are compared with the model's own forward over each
whole sequence (read at each step's last token: one forward per sequence), not with its own forward fed the same
pieces on transformers' cache, which can be wrong in the same way
(transformers' Mamba-1 scan drops the previous state for a multi-token input; see `state_continuation`). This
catches what
no list of features can (a module that does something to attention the paged function cannot see), and the
guard in `paged_forward.check_supported` turns any argument the paged function would ignore into an error here,
at start, instead of in the middle of serving. The verdict is kept on the model per (backend, dtype), and a pass on
disk for later processes that run the same code on this machine (`verdict_disk`).

A bf16 / fp16 model whose paged logits part beyond the tolerance is asked twice more before it is refused: against
its own forward with its attention summed in float32 (as hf_paged's attention sums), then, if that parts too, on
other random sequences (`_another_draw`): a path that is wrong parts on any tokens, while a near tie (a mixture's
router) that rounding flipped parts on a few (Qwen3-Next-shaped in bf16: one of twelve logits at 0.07 of the largest,
the other draw within 0.008). Either agreement is logged as a warning.

It also reports the sliding window each attention layer applied in the last forward (None: none, or not one clear
window): no query of such a layer ever reads a slot more than a window behind it, so the engine groups layers by
window (kv/groups.py) and may give a group's blocks behind its window back.

`counts_padding` answers a question about the model alone, for the generate take-over: whether its own forward on
a left-padded prompt (with the attention mask, and the position ids HF's generate passes) differs from the prompt
alone. Models whose position embeddings count from the cache length instead of the mask (trocr, whisper, marian,
pegasus decoders) do: HF's own left-padded batch shifts a padded row's positions by its padding, which the engine,
serving each prompt at its own positions, does not reproduce.
"""
from __future__ import annotations

import contextlib
import math
import dataclasses
import inspect

import torch

from ..attention import AttentionBackends, AttentionMetadata
from ..config import logger
from ..kv import KVCache
from ..kv.slots import slots_of
from ..kv.state import StateSlots
from . import fp32_attention, verdict_disk
from .forward_lock import forward_lock
from .paged_forward import PagedForwardContext, UnsupportedAttention, paged_attention_active
from .spec import ModelSpec
from .state_layers import StateStep, UnsupportedState, cache_keyword
from .state_modules import own_cache
from .switches import switched_attention

# the step boundaries of each sequence (its length last): step s runs tokens cuts[s-1]:cuts[s] of every sequence, so
# each step mixes prefills from 0, chunks after cached context (crossing blocks) and single-token decodes
STEPS = ((6, 9, 10, 11), (1, 2, 4, 5), (4, 5, 7, 8))
LENGTHS = tuple(cuts[-1] for cuts in STEPS)
BLOCK_SIZE = 4
PADDING = 5  # left padding of `counts_padding`'s prompt
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}  # relative to the largest logit; half precision: 3e-2
HALF = (torch.bfloat16, torch.float16)  # a second reference where the first disagrees: `_float32_reference`
HALF_PROMPTS = 3  # `counts_padding` in half precision: prompts that must all differ


def _paged_logits(model, spec: ModelSpec, backends: AttentionBackends, sequences: list[list[int]]) -> tuple:
    """Run every sequence through the packed steps of `STEPS`: the last logits of each sequence at each step, and the
    (sliding window, attention chunk) each layer's attention call passed in the last step (layer -> pair; None in it:
    none, or several)."""
    device = spec.kv.device
    blocks_per_sequence = -(-max(map(len, sequences)) // BLOCK_SIZE)
    dtype = next(model.parameters()).dtype  # the model's own dtype, also when the engine's cache is fp8
    cache = KVCache(dataclasses.replace(spec.kv, dtype=dtype, groups=None), 1 + blocks_per_sequence * len(sequences),
                    BLOCK_SIZE)
    cache.storage.zero_()
    tables = [[1 + i * blocks_per_sequence + b for b in range(blocks_per_sequence)] for i in range(len(sequences))]
    states = StateSlots(device, len(sequences)) if spec.has_state else None
    results = []
    for step in range(len(STEPS[0])):
        ids, positions, slots, query_lens, context_lens = [], [], [], [], []
        for seq, table, cuts in zip(sequences, tables, STEPS):
            first, last = cuts[step - 1] if step else 0, cuts[step]
            ids += seq[first:last]
            positions += list(range(first, last))
            slots += slots_of(table, first, last, BLOCK_SIZE)
            query_lens.append(last - first)
            context_lens.append(last)
        metadata = AttentionMetadata.build(query_lens, context_lens, tables, slots, BLOCK_SIZE, device)
        context = PagedForwardContext(metadata, cache, backends, windows=[], states=_states(states, query_lens, step))
        with paged_attention_active(spec.configs):
            out = model(input_ids=torch.tensor([ids], device=device),
                        position_ids=torch.tensor([positions], device=device), use_cache=False, paged_context=context)
        _check_calls(model, spec, context.num_calls)
        rows = torch.tensor(query_lens, device=device).cumsum(0) - 1
        results.append(out.logits[0, rows].float())
    seen: dict[int, set] = {}
    for layer, window in context.windows:  # of the last forward (every layer ran once)
        seen.setdefault(layer, set()).add(window)
    return results, {layer: _one_window(windows) for layer, windows in seen.items()}


def _one_window(kinds: set) -> tuple[int | None, int | None]:
    """(window, chunk) of a layer whose calls passed `kinds` ((sliding_window, attention chunk) pairs): each one
    positive int, else None (keep every block)."""
    window, chunk = kinds.pop() if len(kinds) == 1 else (None, None)

    def valid(size) -> int | None:
        return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None
    return valid(window), valid(chunk)


def _states(slots: StateSlots | None, query_lens: list[int], step: int) -> StateStep | None:
    """Sequence i in slot i, starting from no state in the first step."""
    if slots is None:
        return None
    starts = [sum(query_lens[:i]) for i in range(len(query_lens))]
    sequences = [(start, length, i, step == 0, True, ()) for i, (start, length) in enumerate(zip(starts, query_lens))]
    return StateStep.build(slots, sequences, slots.device)


def _check_calls(model, spec: ModelSpec, calls: int) -> None:
    """Every attention layer (every layer but the state layers) must have reached the paged function exactly once in
    the forward."""
    layers = len(spec.kv.stored_layers)
    if calls == layers:
        return
    model_type = getattr(model.config, "model_type", type(model).__name__)
    if calls > layers:
        raise UnsupportedAttention(f"model type {model_type!r}: its {layers} layers call attention "
                                   f"{calls} times per forward (e.g. differential attention); the paged cache holds "
                                   f"one K/V per layer")
    raise UnsupportedAttention(f"model type {model_type!r}: {calls} of its {layers} layers route "
                               f"attention through transformers' AttentionInterface, so its KV cache cannot be paged")


def _own_logits(model, ids: list[int], cuts: tuple, device) -> list[torch.Tensor]:
    """The model's own logits at the last token of each prefix `ids[:cut]` (`cuts`), from ONE forward over `ids` (a
    causal model's row i sees tokens 0..i only: the prefix's last logits; one forward instead of one per prefix, the
    check's largest cost on a big model), called as HF generate calls it: with position ids 0.. when its forward takes
    them (roberta-like models would otherwise derive positions from their padding index)."""
    kwargs = {}
    if "position_ids" in inspect.signature(model.forward).parameters:
        kwargs["position_ids"] = torch.arange(len(ids), device=device)[None]
    logits = model(input_ids=torch.tensor([ids], device=device), **kwargs).logits[0]
    return [logits[cut - 1].float() for cut in cuts]


def _own_by_step(model, sequences: list[list[int]], device) -> list[list[torch.Tensor]]:
    """The model's own last logits of every prefix `seq[:cut]` of `STEPS`, per step (as `_paged_logits` gives them):
    one forward per sequence where the model's own forward is causal; where the first prefix run alone gives other
    logits than its row of the whole sequence (a forward that looks ahead: roberta built without `is_decoder`), each
    prefix runs alone, as generate would feed it."""
    each = [_own_logits(model, seq, cuts, device) for seq, cuts in zip(sequences, STEPS)]
    first = STEPS[0][0]
    alone = _own_logits(model, sequences[0][:first], (first,), device)[0]
    if not _relative_difference(each[0][0], alone) <= TOLERANCE.get(next(model.parameters()).dtype, 3e-2):
        each = [[_own_logits(model, seq[:cut], (cut,), device)[0] for cut in cuts]
                for seq, cuts in zip(sequences, STEPS)]
    return [[logits[step] for logits in each] for step in range(len(STEPS[0]))]


def _takes_cache(model) -> bool:
    """Whether the model's forward takes a cache (rwkv's passes its state as an argument of its own instead)."""
    try:
        return bool(cache_keyword(model.forward))
    except UnsupportedState:
        return False


def _own_stepped_logits(model, ids: list[int], cuts: tuple, device) -> list[torch.Tensor]:
    """The model's own last logits after each cut, run step by step on its own cache (`own_cache`; a refusal says when
    the paged logits are these: the model's own state layers go wrong on such pieces the same way)."""
    cache, results, first = own_cache(model), [], 0
    for last in cuts:
        out = model(input_ids=torch.tensor([ids[first:last]], device=device),
                    position_ids=torch.arange(first, last, device=device)[None], use_cache=True,
                    **{cache_keyword(model.forward): cache})
        results.append(out.logits[0, -1].float())
        first = last
    return results


@torch.inference_mode()
def counts_padding(model) -> bool:
    """Whether the model's own forward on a left-padded prompt, called as HF's generate calls it (the attention mask;
    position ids from the mask when its forward takes them), gives other last logits than the prompt alone: its
    positions count the padding (trocr, whisper, ... decoders: positions from the cache length), or the padding
    reaches it some other way. Then HF's own padded batch is not what the engine computes for a padded row (each
    prompt at its own positions). Two small forwards per prompt, once per model (dtype, device); a forward that fails
    answers True (HF's loop decides). A bf16 / fp16 model answers True only if each of `HALF_PROMPTS` prompts differs:
    in half precision a padded row's other matmul shapes round otherwise, and a router's near tie can turn that into a
    large difference on some prompts (Qwen3-Next-shaped, bf16: 3 of 8 prompts over 3e-2), where a padding that counts
    changes every prompt. See the module doc."""
    param = next(model.parameters())
    key = (str(param.dtype), str(param.device))
    known = model.__dict__.setdefault("_hf_paged_counts_padding", {})
    if key in known:
        return known[key]
    configs = [model.config, model.config.get_text_config(decoder=True)]
    digest = verdict_disk.identity(model, configs, ("padding", key))
    stored = verdict_disk.load("padding", digest)
    if isinstance(stored, bool):
        known[key] = stored
        return stored
    try:
        with forward_lock(model), _reference_attention(configs):
            answer = all(_padding_differs(model, seed) for seed in range(1, 1 + (
                HALF_PROMPTS if param.dtype in HALF else 1)))
    except Exception:  # noqa: BLE001 - a model that fails on a padded prompt: HF's own loop gives HF's behaviour
        return True
    known[key] = answer
    verdict_disk.save("padding", digest, answer)
    return answer


def _padding_differs(model, seed: int) -> bool:
    """`counts_padding`'s comparison on one random prompt (`seed`): its last logits alone and left-padded by
    PADDING."""
    param = next(model.parameters())
    text = model.config.get_text_config(decoder=True)
    vocab = min(getattr(text, "vocab_size", None) or 256, 1000)
    pad = getattr(text, "pad_token_id", None)
    pad = pad if isinstance(pad, int) and 0 <= pad < vocab else 0
    prompt = torch.randint(3, vocab, (LENGTHS[0],), generator=torch.Generator().manual_seed(seed))
    prompt = torch.where(prompt == pad, 3 if pad != 3 else 4, prompt)[None].to(param.device)
    padded = torch.cat([torch.full((1, PADDING), pad, device=param.device), prompt], dim=1)
    mask = (torch.arange(padded.shape[1], device=param.device) >= PADDING).long()[None]
    takes_positions = "position_ids" in inspect.signature(model.forward).parameters
    alone = {"position_ids": torch.arange(prompt.shape[1], device=param.device)[None]} if takes_positions else {}
    want = model(input_ids=prompt, attention_mask=torch.ones_like(prompt), **alone).logits[0, -1].float()
    with_pad = {"position_ids": model._prepare_position_ids_for_generation(padded, {"attention_mask": mask})
                } if takes_positions else {}
    got = model(input_ids=padded, attention_mask=mask, **with_pad).logits[0, -1].float()
    return not _relative_difference(got, want) <= TOLERANCE.get(param.dtype, 3e-2)


def _worst(paged: list, own: list) -> float:
    """The largest `_relative_difference` of the paged logits of each step ([sequences, vocab]) from `own` (per step,
    one logits vector per sequence)."""
    return max(_relative_difference(got, torch.stack(want)) for got, want in zip(paged, own))


def _relative_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| relative to the largest finite |want|. Entries non-finite in both count as equal (a
    model whose weights already give NaN for some token is no reason to refuse it); NaN in one only is a mismatch:
    inf (a NaN would be lost in a later `max` of several, Python's `max` keeps its first argument over a NaN)."""
    both = ~torch.isfinite(got) & ~torch.isfinite(want)
    diff = float(torch.where(both, torch.zeros_like(got), (got - want).abs()).max())
    finite = want[torch.isfinite(want)]
    scale = float(finite.abs().max()) if finite.numel() else 1.0
    return math.inf if math.isnan(diff) else diff / max(scale, 1e-6)


def _second_opinions(model, spec: ModelSpec, backends: AttentionBackends, sequences: list, paged: list, worst: float,
                     tolerance: float) -> float:
    """A half-precision model's paged logits over `tolerance` (`worst`): rounding that its later layers amplify (the
    float32-attention reference), or a near tie these tokens met (`_another_draw`; not for a NaN or inf only one side
    has: no near tie)? The first that agrees is logged and its difference returned; else `worst`."""
    opinions = ((lambda: _float32_reference(model, spec, sequences, paged),
                 "agree with its own forward summing its attention in float32 (%.2e), as hf_paged's attention sums: "
                 "rounding its later layers amplify (a router's near tie)"),
                (lambda: _another_draw(model, spec, backends, tolerance),
                 "agree with it on other random tokens (%.2e), where the float32-attention reference parts on the "
                 "check's too: a near tie (a router's) that rounding flipped there, not a path that is wrong"))
    for opinion, why in opinions if math.isfinite(worst) else opinions[:1]:
        other = opinion()
        if other <= tolerance:
            logger.warning("hf_paged: model type %r (%s): the paged logits part from its own forward's by %.2e of the "
                           "largest logit, and " + why + "; served",
                           getattr(model.config, "model_type", type(model).__name__), next(model.parameters()).dtype,
                           worst, other)
            return other
    return worst


def _draw(spec: ModelSpec, seed: int) -> list[list[int]]:
    """The check's random sequences (of LENGTHS tokens) for `seed`."""
    generator = torch.Generator().manual_seed(seed)
    vocab = min(spec.vocab_size, 1000)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in LENGTHS]


def _another_draw(model, spec: ModelSpec, backends: AttentionBackends, tolerance: float) -> float:
    """The comparison again on other random sequences (a half-precision model that failed it on the first ones): the
    worst difference, or the float32-attention reference's where that one is over `tolerance`; inf where the paged
    path fails. A path that is wrong parts on any tokens; a near tie that rounding flips, on a few."""
    sequences = _draw(spec, 1)
    try:
        with forward_lock(model):
            paged, _ = _paged_logits(model, spec, backends, sequences)
            with _reference_attention(spec.configs):
                own = _own_by_step(model, sequences, spec.kv.device)
    except Exception:  # noqa: BLE001 - no second opinion: the first verdict stands
        return float("inf")
    worst = _worst(paged, own)
    return worst if worst <= tolerance else min(worst, _float32_reference(model, spec, sequences, paged))


def _float32_reference(model, spec: ModelSpec, sequences: list[list[int]], paged: list) -> float:
    """The worst difference of the paged logits from the model's own forward with its attention summed in float32
    (`fp32_attention`), or inf where that reference cannot run."""
    try:
        with forward_lock(model), _reference_attention(spec.configs), fp32_attention.float32_attention(spec.configs):
            own = _own_by_step(model, sequences, spec.kv.device)
    except Exception:  # noqa: BLE001 - no such reference (NoReference, a model it does not fit): the first verdict
        return float("inf")
    return _worst(paged, own)


def _own_positions(model) -> str:
    """A hint for the refusal: position-embedding modules that compute positions themselves (no `position_ids`
    argument, e.g. from the token ids or a cache length), which the engine's packed steps cannot set right."""
    own = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("PositionalEmbedding")
                  and "position_ids" not in inspect.signature(m.forward).parameters})
    return f" (its {', '.join(own)} computes positions itself, not from position ids)" if own else ""


def _window_fields(config) -> tuple:
    """What the config says of windows (attention modules read it on every forward): a change checks again."""
    text = config.get_text_config(decoder=True)
    return tuple(repr(getattr(text, name, None)) for name in ("sliding_window", "layer_types", "use_sliding_window",
                                                              "max_window_layers", "attention_chunk_size"))


def _reference_attention(configs: list):
    """Where the model's own forward gives the reference logits: its configured attention, except that a model loaded
    with transformers' continuous-batching attention ("paged|eager") is compared with the plain one after the "|"
    (outside transformers' batching loop its "paged|" functions apply no causal mask). `configs`: the model's
    configs (others are skipped)."""
    configs = [c for c in configs if isinstance(getattr(c, "_attn_implementation", None), str)]
    names = {c._attn_implementation for c in configs}
    if len(names) != 1 or not next(iter(names)).startswith("paged|"):
        return contextlib.nullcontext()
    return switched_attention(configs, next(iter(names)).split("|", 1)[1])


@torch.inference_mode()
def check_paged_matches_model(model, spec: ModelSpec, backends: AttentionBackends) -> dict[int, tuple]:
    """Raise ValueError when the paged forward does not reproduce the model's own logits (see the module doc).
    Returns (sliding window, attention chunk) of each attention layer (layer -> pair, None: not limited that way)."""
    dtype = next(model.parameters()).dtype
    # the verdict depends on the mode too: dropout in training mode makes no two forwards agree
    key = (backends.name, str(dtype), str(spec.kv.device), _window_fields(model.config), model.training,
           spec.substituted)
    verdicts = model.__dict__.setdefault("_hf_paged_probe", {})
    windows = model.__dict__.setdefault("_hf_paged_window", {})
    if key in verdicts:
        if verdicts[key] is not None:
            raise ValueError(verdicts[key])
        return dict(windows.get(key, {}))
    # state modules on substitute forwards (state_fast) are chosen per process by timing: another process may run
    # another combination, which this pass would not cover; such models are checked in every process
    digest = None if spec.substituted else verdict_disk.identity(model, spec.configs, ("check", key))
    stored = verdict_disk.load("check", digest)  # a pass of the same code on this machine, in an earlier process
    if isinstance(stored, list) and all(isinstance(e, list) and len(e) == 3 for e in stored):
        verdicts[key] = None
        windows[key] = {int(layer): (window, chunk) for layer, window, chunk in stored}
        return dict(windows[key])
    model_type = getattr(model.config, "model_type", type(model).__name__)
    sequences = _draw(spec, 0)
    with forward_lock(model):
        try:
            paged, layer_windows = _paged_logits(model, spec, backends, sequences)
        except UnsupportedAttention as e:
            verdicts[key] = str(e)
            raise ValueError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - a failing paged path refuses the model, with the cause; not kept
            # as the model's verdict: the failure may be passing (the next engine checks again)
            raise ValueError(f"model type {model_type!r}: its forward fails on hf_paged's paged path "
                             f"({type(e).__name__}: {e})") from e
        # each whole sequence at once, for state models too (the pieces of a state layer must give what it gives)
        with _reference_attention(spec.configs):
            own = _own_by_step(model, sequences, spec.kv.device)
    tolerance = TOLERANCE.get(dtype, 3e-2)
    worst = _worst(paged, own)
    if not worst <= tolerance and dtype in HALF:
        worst = _second_opinions(model, spec, backends, sequences, paged, worst, tolerance)
    if not worst <= tolerance:  # also catches NaN
        hint = _own_positions(model)
        if spec.has_state and _takes_cache(model):
            with forward_lock(model), _reference_attention(spec.configs):
                stepped = [_own_stepped_logits(model, seq, cuts, spec.kv.device) for seq, cuts in zip(sequences, STEPS)]
            if _worst(paged, [[logits[step] for logits in stepped] for step in range(len(STEPS[0]))]) <= tolerance:
                hint += (" (its own forward fed the same pieces on its own cache gives the same logits: a state "
                         "layer that drops its previous state for a multi-token input)")
        verdicts[key] = (f"model type {model_type!r}: hf_paged's paged attention does not reproduce the model's own "
                         f"attention (largest logit difference {worst:.2e} of the largest logit, tolerance "
                         f"{tolerance:.0e}){hint}; it is refused rather than served wrong")
        raise ValueError(verdicts[key])
    # a pass is kept only here, once every opinion is in (an interrupt in a second opinion or the hint's forwards
    # leaves no verdict: the next engine checks again)
    verdicts[key] = None
    windows[key] = layer_windows
    verdict_disk.save("check", digest, [[layer, *pair] for layer, pair in sorted(layer_windows.items())])
    return dict(layer_windows)
