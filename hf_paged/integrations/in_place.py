"""When `generate` in HF's own loop on a `PagedCache` may switch the model to the "paged_cache" attention (decodes
read the pages in place; model/cache_attention.py), and the call that does it.

Decided by what the model does, once per model: a 3-token forward and one decode step on a PagedCache under
"paged_cache" must run and give the logits sdpa gives on a DynamicCache. Models whose attention code touches the K/V
a cache returns before handing them to the attention function (diffllama splits them, doge and jetmoe reshape them)
fail that probe and keep the gathered copy.
"""
from __future__ import annotations

import torch

from ..model import CACHE_ATTENTION_NAME, attention_implementation, describe_model, forward_lock
from .paged_cache import PagedCache


def call_reading_in_place(original, model, arguments: dict, extra: dict, configs: list | None):
    """HF's generate, with `configs` (when given) on the "paged_cache" attention for the call. The model's forward
    lock is held throughout: an engine on the same model in another thread switches its attention to "paged" for
    each of its forwards, which this call's forwards must never meet."""
    with forward_lock(model), attention_implementation(configs or [], CACHE_ATTENTION_NAME):
        return original(model, **arguments, **extra)


def on_a_paged_cache(original, model, arguments: dict, extra: dict):
    """`generate(..., cache=PagedCache(...))` without asking for "paged": HF's call as it is, its attention reading
    the pages in place where the model allows it."""
    try:
        spec = describe_model(model)
    except ValueError:  # a model the engine refuses may still run HF's loop on a PagedCache (with gathered copies)
        spec = None
    arguments.pop("self", None)
    configs = in_place_configs(model, spec, arguments, extra) if spec is not None else None
    return call_reading_in_place(original, model, arguments, extra, configs)


def in_place_configs(model, spec, arguments: dict, extra: dict) -> list | None:
    """The configs to switch to "paged_cache" for a call in HF's loop: those the model's attention reads, when all
    are on sdpa, every attention module goes through transformers' attention interface and the model passes the
    probe; None otherwise (also when attention weights are asked for: HF's own path then stays exactly as it is)."""
    if spec.interface_layers != spec.kv.num_layers:  # some layer's attention does not reach the interface
        return None
    configs = [c for c in spec.configs if hasattr(c, "_attn_implementation_internal")]
    if not configs or any(c._attn_implementation != "sdpa" for c in configs):
        return None
    config = arguments.get("generation_config") or model.generation_config
    if extra.get("output_attentions", getattr(config, "output_attentions", False)):
        return None
    return configs if reads_in_place_correctly(model, configs) else None


def reads_in_place_correctly(model, configs: list) -> bool:
    """The probe (kept on the model): a 3-token forward and one decode step, on a DynamicCache with sdpa and on a
    PagedCache with "paged_cache", run and give the same last logits (to 1e-3: the decode kernel sums in another
    order than sdpa; a wrong attention is off by far more)."""
    known = model.__dict__.get("_hf_paged_reads_in_place")
    if known is None:
        known = model.__dict__["_hf_paged_reads_in_place"] = _probe(model, configs)
    return known


@torch.inference_mode()
def _probe(model, configs: list) -> bool:
    from transformers import DynamicCache

    device = next(model.parameters()).device
    prompt, step = torch.tensor([[1, 2, 3]], device=device), torch.tensor([[4]], device=device)

    def last_logits(cache) -> list[torch.Tensor]:
        first = model(input_ids=prompt, cache=cache, use_cache=True).logits[:, -1]
        return [first, model(input_ids=step, cache=cache, use_cache=True).logits[:, -1]]

    try:
        with forward_lock(model):
            expected = last_logits(DynamicCache(config=model.config))
            with attention_implementation(configs, CACHE_ATTENTION_NAME):
                got = last_logits(PagedCache(model.config))
    except Exception:  # noqa: BLE001 - whatever fails here runs on the gathered copy, as HF's own attention expects
        return False
    return all(torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-3) for a, b in zip(got, expected))
