"""The "paged" attention implementation as transformers sees it (it has no mask function: see `paged_mask`)."""
from __future__ import annotations

import inspect
import threading
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch

from ..attention import AttentionBackends, AttentionMetadata, LayerExtras, store_kv
from ..kv import KVCache
from .kv_shapes import cut_to_value, fit_to_pages, page_mismatch, record_kv_shapes
from .signatures import parameter_names
from .switches import ThreadForward, switched_attention

ATTENTION_NAME = "paged"
SHAPES_NAME = "hf_paged_kv_shapes"  # the attention implementation that records K/V shapes (record_kv_shapes)
PASSED_DOWN = ("paged_context", "hf_paged_kv_shapes")  # forward keywords ModulePatches hands to attention modules


@dataclass(slots=True)
class PagedForwardContext:
    """Travels through the model's forward kwargs (`paged_context=`) down to every attention call. `backends`: the
    engine's chooser (made once per engine), which names the backend object each layer's call runs on."""

    metadata: AttentionMetadata
    kv_cache: KVCache
    backends: AttentionBackends
    num_calls: int = 0  # attention calls that reached the paged function in this forward (one per layer)
    windows: list | None = None  # the start-up check's list: gets the sliding_window each call passed (None: none)
    states: object = None  # the step's `state_layers.StateStep` on a model with state layers
    group_metadata: list | None = None  # with several KV groups, each one's (`metadata`: the first group's)
    # id(attention module) -> (module, its LayerCall): what a module's calls need that never changes between steps,
    # found on its first call; the engine hands the same dict to every step (a new dict: found again)
    layer_calls: dict = field(default_factory=dict)
    # the packed rows whose final hidden states the LM head reads (the `logits_to_keep` the engine passed; None: every
    # row): the last layer may compute only those after its attention (read_rows.py)
    rows_read: object = None

    def metadata_of(self, layer: int) -> AttentionMetadata:
        """The metadata layer `layer` reads and writes its pages with."""
        if self.group_metadata is None:
            return self.metadata
        return self.group_metadata[self.kv_cache.layer_group[layer]]


# keywords an attention module may pass that change nothing here (the engine's own, or flags it already honours)
IGNORED_KEYWORDS = frozenset({"position_ids", "use_cache", "cache_position", "output_router_logits",
                              "output_attentions", "is_causal", "layer_idx", "logits_to_keep"})


class UnsupportedAttention(ValueError):
    """The model's attention asks for something the paged attention does not implement."""


def check_supported(module, args: tuple, dropout: float, kwargs: dict) -> None:
    """Refuse, naming the model type and the feature, anything this function would otherwise ignore: extra
    positional arguments, a per-head sink (`s_aux` / `sinks`), an attention bias (ALiBi), unknown keywords with a
    value, dropout in training mode, a non-causal call. Silently wrong attention is worse than none."""
    model_type = _model_type(module)
    if args:
        raise UnsupportedAttention(f"model type {model_type!r}: its attention passes {len(args)} extra positional "
                                   f"argument(s), which hf_paged's paged attention does not implement")
    if dropout:
        raise UnsupportedAttention(f"model type {model_type!r}: attention dropout {dropout} (the model is in "
                                   f"training mode; call model.eval())")
    if kwargs.get("is_causal") is False:
        raise UnsupportedAttention(f"model type {model_type!r}: non-causal attention is not supported")
    odd = sorted(k for k, v in kwargs.items() if k not in IGNORED_KEYWORDS and v is not None and v is not False)
    if odd:
        raise UnsupportedAttention(f"model type {model_type!r}: its attention passes {odd}, which hf_paged's paged "
                                   f"attention does not implement (e.g. attention sinks or an attention bias)")


def paged_attention_forward(module, query, key, value, attention_mask, *args, scaling=None, dropout=0.0,
                            sliding_window=None, softcap=None, paged_context: PagedForwardContext | None = None,
                            **kwargs):
    """transformers calls this with query [1, H, T, D], key/value [1, H_kv, T, D] (packed step, positions
    already rotated). Stores the new K/V in their slots and attends over each sequence's pages. Anything else the
    module asks for is refused (`check_supported`), never ignored."""
    if paged_context is None:
        raise UnsupportedAttention(f"the 'paged' attention implementation got no paged_context: it runs only inside "
                                   f"hf_paged's engine, and a model of type {_model_type(module)!r} must pass its "
                                   f"forward's keyword arguments down to its attention modules")
    sinks = kwargs.pop("s_aux", None)  # per-head attention-sink logits (gpt-oss, granite_swa, flint)
    relative = kwargs.pop("relative_logits", None)  # [1, T, H, E] from a paged forward of its own (relative_attention)
    if args or dropout or (kwargs and not IGNORED_KEYWORDS.issuperset(kwargs)) or kwargs.get("is_causal") is False:
        check_supported(module, args, dropout, kwargs)
    call = _layer_call(module, paged_context)
    if call.temperature:
        query = _llama4_temperature(module, query, paged_context.metadata)
    extras = None
    if sinks is not None or relative is not None or call.chunk_size:
        extras = LayerExtras(sinks=sinks, chunk_size=call.chunk_size,
                             relative_logits=None if relative is None else relative[0])
    out = attend_paged(module, query, key, value, paged_context, scaling, sliding_window, softcap, extras, call.layer)
    return out[None], None


@dataclass(frozen=True, slots=True)
class LayerCall:
    """What an attention module's paged calls need that is the same in every step."""

    layer: int  # whose pages it reads and writes (`_layer_of`)
    chunk_size: int | None  # a chunked_attention layer's chunk (`_chunk_size`)
    temperature: bool  # llama4's NoPE query temperature applies (`_llama4_temperature`)


def _layer_call(module, context: PagedForwardContext) -> LayerCall:
    """The module's LayerCall, found once per engine (`context.layer_calls`). A model whose K/V are stored by call
    (several calls per module) finds its layer from the call count every time."""
    by_call = context.kv_cache.spec.by_call
    found = None if by_call else context.layer_calls.get(id(module))
    if found is None or found[0] is not module:
        layer = _layer_of(module, context)
        found = (module, LayerCall(layer, _chunk_size(module, layer), _has_temperature(module)))
        if not by_call:
            context.layer_calls[id(module)] = found
    return found[1]


def _has_temperature(module) -> bool:
    return bool(getattr(module, "attn_temperature_tuning", False)) and not getattr(module, "use_rope", True)


def _layer_of(module, context: PagedForwardContext) -> int:
    """The layer whose K/V this call stores: the module's `layer_idx`, or for a model whose K/V are stored by call
    (kv_shapes.number_calls) the call's place in the forward (the same place in every forward)."""
    layer = getattr(module, "layer_idx", None)
    return context.num_calls if layer is None or context.kv_cache.spec.by_call else layer


def attend_paged(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, context: PagedForwardContext,
                 scaling: float | None, sliding_window: int | None = None, softcap: float | None = None,
                 extras: LayerExtras | None = None, layer: int | None = None) -> torch.Tensor:
    """query [1, H, T, D], key / value [1, H_kv, T, D] of layer `layer` (default `module.layer_idx`) -> [T, H, D]: the
    new K/V go into their slots, then attention over each sequence's pages. Counts the call (the start-up check
    compares the count with the number of layers)."""
    context.num_calls += 1
    layer = module.layer_idx if layer is None else layer
    if context.windows is not None:
        context.windows.append((layer, (sliding_window, extras.chunk_size if extras is not None else None)))
    cache = context.kv_cache
    reason = page_mismatch(cache.spec, layer, key, value)
    if reason is not None:
        raise UnsupportedAttention(f"model type {_model_type(module)!r}: {reason}")
    meta = context.metadata_of(layer)
    v_size = value.shape[3]
    q, k, v, scaling = fit_to_pages(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                                    scaling)
    scales = cache.scales_for(layer, k, v)
    store_kv(k, v, cache.key_caches[layer], cache.value_caches[layer], meta.slot_mapping, *scales)
    return cut_to_value(context.backends.attend(q, cache.key_caches[layer], cache.value_caches[layer], meta, scaling,
                                                sliding_window, softcap, key=k, value=v, kv_scales=scales,
                                                extras=extras), v_size)


def _model_type(module) -> str:
    return getattr(getattr(module, "config", None), "model_type", type(module).__name__)


def _chunk_size(module, layer: int) -> int | None:
    """The attention chunk of a "chunked_attention" layer (llama4: `config.attention_chunk_size`), else None."""
    config = getattr(module, "config", None)
    layer_types = getattr(config, "layer_types", None)
    if not layer_types or getattr(module, "layer_idx", None) is None or layer_types[layer] != "chunked_attention":
        return None
    chunk = getattr(config, "attention_chunk_size", None)
    if not chunk:
        raise UnsupportedAttention(f"model type {_model_type(module)!r}: layer {layer} is a "
                                   f"chunked_attention layer without an attention_chunk_size")
    return int(chunk)


def sequence_positions(metadata) -> torch.Tensor:
    """Each packed row's position in its own sequence [T] (int64): the step's rows of sequence b are its last
    query_len positions before context_lens[b]."""
    cu = metadata.cu_seqlens_q.long()
    query_lens = cu[1:] - cu[:-1]
    rows = metadata.slot_mapping.shape[0]  # a shape: no host sync (CUDA graphs), nor below with output_size
    start = (metadata.context_lens.long() - query_lens - cu[:-1]).repeat_interleave(query_lens, output_size=rows)
    return start + torch.arange(rows, device=cu.device)  # row t of sequence b: context - q_len + (t - cu[b])


def _llama4_temperature(module, query: torch.Tensor, metadata) -> torch.Tensor:
    """llama4's NoPE layers scale queries by 1 + attn_scale * log1p(floor((pos + 1) / floor_scale)) with pos taken
    as the row index of the (cache-less, packed) forward; redo it with each row's true position in its sequence.
    The identity (returns `query` itself) for every other module; below floor_scale every factor is exactly 1."""
    if not _has_temperature(module):
        return query
    positions = sequence_positions(metadata)
    rows = torch.arange(query.shape[2], device=query.device)

    def temperature(pos: torch.Tensor) -> torch.Tensor:
        return torch.log1p(torch.floor((pos.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0

    ratio = temperature(positions) / temperature(rows)  # exactly 1.0 below floor_scale: no change; no host sync
    return (query * ratio.view(1, 1, -1, 1)).to(query.dtype)


def paged_mask(*args, **kwargs):
    """The mask function of the shape recorder: no mask. The paged attention itself registers no mask function, so
    transformers' mask builders return None at once (an attention implementation without a mask function is one that
    "needs no mask"): causality comes from the metadata, and a packed step's position ids are not read."""
    return None


@dataclass(slots=True)
class ModulePatches:
    """What some models need, for the duration of one paged forward, beyond switching `_attn_implementation`:

    - `adapters` [(module, factory)]: attention modules that compute attention themselves instead of calling
      transformers' AttentionInterface (bloom, mpt: ALiBi is added inside the module). Each one's forward is replaced
      by `factory(module, self)`: the module's own projections, then the paged attention with its ALiBi slopes.
    - `injected` [module]: attention modules whose callers drop the forward's keywords (stablelm's decoder layer):
      a pre-hook hands them the keywords the top-level forward got (`paged_context=`, or the shape recorder's).
    - `positioned` [module]: position-embedding modules that take `position_ids` but whose models compute them as
      `arange(T) + cache length` (bart, whisper, ... decoders), wrong for a packed step: a pre-hook passes each
      row's position in its own sequence instead (what HF computes for that sequence alone).

    The keywords are taken from the top-level forward by a pre-hook on `model`. Outside `installed()` every module
    is exactly as found (hooks removed, instance-level forwards restored). Inside, only the installing thread sees
    any of it: the hooks do nothing and the forwards (`switches.ThreadForward`) are the modules' own in any other
    thread, so a plain forward of the model there is untouched."""

    model: torch.nn.Module
    adapters: list
    injected: list
    positioned: list = field(default_factory=list)
    keywords: dict = field(default_factory=dict)
    thread: int | None = None  # the thread inside `installed()`

    @property
    def context(self) -> PagedForwardContext | None:
        return self.keywords.get("paged_context")

    @contextmanager
    def installed(self):
        hooks = [self.model.register_forward_pre_hook(self._capture, with_kwargs=True)]
        hooks += [m.register_forward_pre_hook(self._inject, with_kwargs=True) for m in self.injected]
        hooks += [m.register_forward_pre_hook(self._place, with_kwargs=True) for m in self.positioned]
        found = [module.__dict__.get("forward") for module, _ in self.adapters]  # instance-level forwards, if any
        outer, self.thread = self.thread, threading.get_ident()
        try:
            for (module, factory), previous in zip(self.adapters, found):
                module.forward = ThreadForward(module, factory(module, self), previous)
            yield
        finally:
            for hook in hooks:
                hook.remove()
            self.keywords, self.thread = {}, outer
            for (module, _), previous in zip(self.adapters, found):
                module.__dict__.pop("forward", None)
                if previous is not None:
                    module.forward = previous

    def __deepcopy__(self, memo):  # a model copied mid-forward keeps our hooks: in the copy they do nothing
        return ModulePatches(memo.get(id(self.model), self.model), [], [])

    def _capture(self, _, args, kwargs) -> None:
        if self.thread == threading.get_ident():
            self.keywords = {k: kwargs[k] for k in PASSED_DOWN if k in kwargs}

    def _inject(self, _, args, kwargs):
        if self.thread != threading.get_ident():
            return None
        return args, {**self.keywords, **kwargs}

    def _place(self, module, args, kwargs):
        if self.thread != threading.get_ident() or self.context is None:
            return None
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
        given = bound.arguments.get("position_ids")  # the model's own: [T] or [1, T]; ours in the same shape
        positions = sequence_positions(self.context.metadata)  # [T] where the model passes none (bart's form)
        bound.arguments["position_ids"] = positions if given is None else positions.view(given.shape)
        return bound.args, bound.kwargs

    def require_context(self, module) -> PagedForwardContext:
        if self.context is None:
            raise UnsupportedAttention(f"model type {_model_type(module)!r}: its forward got no paged_context")
        return self.context


def paged_attention_active(configs: list):
    """The model's configs read the "paged" implementation for one forward, in this thread only (nothing is written
    to them: `switches.switched_attention`). `ModulePatches` among them are installed for the same duration."""
    return attention_implementation(configs, ATTENTION_NAME)


def attention_implementation(configs: list, name: str):
    """The configs' attention implementation is `name` inside, for this thread only; `ModulePatches` among
    `configs` are installed for the same duration (removed even on error). Raises `switches.HfPagedDisabled` after
    `hf_paged.disable()`."""
    if not any(isinstance(c, ModulePatches) for c in configs):
        return switched_attention(configs, name)
    return _with_patches(configs, name)


@contextmanager
def _with_patches(configs: list, name: str):
    patches = [c for c in configs if isinstance(c, ModulePatches)]
    configs = [c for c in configs if not isinstance(c, ModulePatches)]
    with switched_attention(configs, name), ExitStack() as stack:
        for p in patches:
            stack.enter_context(p.installed())
        yield


def position_takers(model: torch.nn.Module) -> list:
    """Position-embedding modules (class name ending in "PositionalEmbedding") whose forward takes `position_ids`."""
    return [m for m in model.modules() if type(m).__name__.endswith("PositionalEmbedding")
            and "position_ids" in parameter_names(m.forward)]


def keyword_takers(model: torch.nn.Module) -> list:
    """Modules that may call attention (they have a `layer_idx`) and take arbitrary keywords: where `ModulePatches`
    injects the forward's keywords for models whose layers drop them."""
    found = []
    for module in model.modules():
        if module is model or getattr(module, "layer_idx", None) is None:
            continue
        params = inspect.signature(module.forward).parameters.values()
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            found.append(module)
    return found


def _forget(mapping: dict, key: str) -> None:
    mapping.pop(key, None)


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)  # no mask function: see paged_mask
    AttentionInterface.register(SHAPES_NAME, record_kv_shapes)
    AttentionMaskInterface.register(SHAPES_NAME, paged_mask)


def unregister() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for name in (ATTENTION_NAME, SHAPES_NAME):
        _forget(AttentionInterface._global_mapping, name)
        _forget(AttentionMaskInterface._global_mapping, name)
