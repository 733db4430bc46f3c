"""What the engine needs to know about a transformers model, and whether it can serve it at all."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv import KVCacheSpec
from . import verdict_disk
from .forward_lock import forward_lock
from .kv_shapes import layer_shapes, number_calls
from .paged_forward import SHAPES_NAME, ModulePatches, attention_implementation, keyword_takers, position_takers
from .relative_attention import relative_attention_modules
from .self_attending import self_attending_modules
from .signatures import parameter_names
from .state_continuation import continuation_modes
from .state_fast import fast_paths
from .own_state import own_state_modules
from .state_layers import UnsupportedState, cache_keyword, own_forward, state_forward
from .state_modules import find_state_modules
from .switches import require_enabled

SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}


@dataclass(slots=True)
class ModelSpec:
    kv: KVCacheSpec
    max_model_len: int | None
    vocab_size: int
    accepts_logits_to_keep: bool
    # every config object whose `_attn_implementation` the forward reads, plus the `ModulePatches` that
    # `paged_attention_active` installs for models that need them (for bloom / mpt, whose attention modules compute
    # attention themselves, only those)
    configs: list
    # how many layers' attention the probe forward saw go through transformers' attention interface (0: none did)
    interface_layers: int = 0
    # state layers (linear attention, Mamba, short convolutions): {name of a module holding state: its layer} (a
    # layer may have several: `state_modules.find_state_modules`); {} for none
    state_layers: dict = None
    # state modules running a faster forward of hf_paged's (model/state_fast.py) instead of their own
    substituted: bool = False

    @property
    def has_state(self) -> bool:
        return bool(self.state_layers)


def describe_model(model: torch.nn.Module, substitutes: bool = True) -> ModelSpec:
    """Refuse what the config already shows cannot be paged (encoder-decoder, layers other than full, sliding or
    chunked attention), and read the KV shapes from what the attention modules produce (`module_kv_shape`). Whether
    the model's attention really goes through transformers' AttentionInterface (or a paged forward of its own
    attention modules, `ModulePatches`), with those shapes and nothing the paged function ignores, is decided by
    what it does: `probe.check_paged_matches_model` runs it once. Raises ValueError naming the model type and the
    reason. `substitutes=False`: every state module runs its own forward (no `state_fast` substitutes)."""
    require_enabled()  # after hf_paged.disable(): HfPagedDisabled, saying how to re-enable
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "generation_config"):
        raise ValueError(f"{type(model).__name__} is not a transformers generative model")
    forward_lock(model)  # placed now: a copy taken in the middle of an hf_paged forward loses our leftovers here
    model_type = getattr(config, "model_type", type(model).__name__)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"model type {model_type!r} is encoder-decoder; hf_paged serves decoder-only models")
    text = config.get_text_config(decoder=True)
    layer_types = getattr(text, "layer_types", None) or []
    state = _state_layers(model, model_type)
    odd = sorted(set(layer_types) - SUPPORTED_LAYER_TYPES)
    if odd and not state:
        raise ValueError(f"model type {model_type!r} has layers of type {odd} whose state hf_paged cannot hold: it "
                         f"serves attention layers (full, sliding-window, chunked) and state layers that keep their "
                         f"state through transformers' linear-attention cache calls (or, bridged to them, on their "
                         f"modules or in an argument passed down: own_state.OWN_STATE)")
    num_heads = getattr(text, "num_attention_heads", None)
    num_layers = getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer", None)
    hidden = getattr(text, "hidden_size", None)
    if not num_layers or not hidden or not (num_heads or state):
        raise ValueError(f"model type {model_type!r} config lacks attention heads / layers / hidden size")
    param = next(model.parameters())
    shapes, configs, (by_call, attention) = _switched(model, [config] + ([text] if text is not config else []),
                                                      model_type)
    num_layers = max(num_layers, len(attention)) if by_call else num_layers
    if shapes:
        num_kv_heads, head_dim, _ = shapes[min(shapes)]
    elif state and not attention:  # a stack of state layers only: the KV cache holds no layer
        num_kv_heads, head_dim = 1, 1
    else:  # the modules' attention did not run through the interface: the config's word (the start-up check decides)
        num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
        head_dim = getattr(text, "head_dim", None) or hidden // num_heads
    if state:  # {module name: its layer}: a layer may have several state modules, each patched on its own
        modules = {name: model.get_submodule(name) for name in state}
        modes = continuation_modes(model, state)  # how each module must run a continuation of several tokens
        # faster forwards where they agree with the module's own and win here
        fast = fast_paths(model, state) if substitutes else dict.fromkeys(state)
        configs = configs + [ModulePatches(model, [
            (module, state_forward(state[name], cache_keyword(own_forward(module)), modes[name], fast[name]))
            for name, module in modules.items()], [])]
    forward_params = parameter_names(model.forward)
    return ModelSpec(
        kv=KVCacheSpec(num_layers, num_kv_heads, head_dim, param.dtype, param.device,
                       attention_layers=attention if state or by_call else None,
                       layer_shapes=shapes or None, by_call=by_call),
        max_model_len=getattr(text, "max_position_embeddings", None),
        vocab_size=text.vocab_size,
        accepts_logits_to_keep="logits_to_keep" in forward_params,
        configs=configs,
        interface_layers=len(attention),
        state_layers=state,
        substituted=bool(state) and any(forward is not None for forward in fast.values()),
    )


def _state_layers(model: torch.nn.Module, model_type: str) -> dict:
    """`find_state_modules` and `own_state_modules` (modules keeping their state on themselves or in a passed
    argument), the refusals as ValueError naming the model."""
    try:
        return {**find_state_modules(model), **own_state_modules(model)}
    except UnsupportedState as e:
        raise ValueError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - a forward that runs neither on transformers' cache nor on one of its own
        raise ValueError(f"model type {model_type!r} has state layers, but its forward does not run on "
                         f"transformers' own cache ({type(e).__name__}: {e}); hf_paged holds the state of layers that "
                         f"keep it through transformers' linear-attention cache calls (or minimax's own cache's "
                         f"get_linear_cache / set_linear_cache)") from e


def _switched(model: torch.nn.Module, configs: list, model_type: str) -> tuple[dict | None, list, tuple]:
    """(the modules' K/V shapes {layer: (heads, K size, V size)} or None, what `paged_attention_active` switches:
    the configs and any ModulePatches, the layers whose attention went through the interface)."""
    adapters = self_attending_modules(model)
    if adapters:  # their modules never read `_attn_implementation`: masks stay as HF builds them
        shape, configs, layers = None, [ModulePatches(model, adapters, [])], (False, ())
    else:
        shape, configs, layers = module_kv_shape(model, configs, model_type)
    positioned = position_takers(model)
    relative = relative_attention_modules(model)  # a learned relative-position bias: a paged forward of their own
    patches = [ModulePatches(model, relative, [], positioned)] if positioned or relative else []
    return shape, configs + patches, layers


def module_kv_shape(model: torch.nn.Module, configs: list,
                    model_type: str) -> tuple[dict | None, list, tuple[bool, tuple]]:
    """{layer: (K/V heads, K size, V size)} as the model's attention modules produce them, the configs to switch
    (with a `ModulePatches` that hands the forward's keywords to attention modules when the model's layers drop
    them). Read from one 2-token forward with an attention function that records the shapes (`record_kv_shapes`),
    kept on the model (and on disk for later processes: `verdict_disk`); and the layers recorded. Shapes None when
    no layer's attention ran through the interface (the config's sizes are used, and the start-up check has the
    last word). Layers may differ, and K from V in head size (model/kv_shapes.py); raises ValueError when a layer's
    K and V differ in heads."""
    known = model.__dict__.get("_hf_paged_kv_shape")
    digest = verdict_disk.identity(model, [model.config], ("kv_shapes",)) if known is None else None
    if known is None:
        known = _stored_shapes(digest)  # what the same code recorded on this machine before
        if known is not None:
            model.__dict__["_hf_paged_kv_shape"] = known
    if known is None:
        found, injected = _recorded_shapes(model, configs), False
        if not found:  # maybe its layers drop the forward's keywords: hand them down
            found = _recorded_shapes(model, configs + [_injector(model)])
            injected = bool(found)
        known = (found or [], injected)
        if found is not None:  # a forward that failed (maybe passingly) is not kept
            model.__dict__["_hf_paged_kv_shape"] = known
            verdict_disk.save("kv_shapes", digest, {"calls": [[layer, list(shape)] for layer, shape in known[0]],
                                                    "injected": injected})
    calls, injected = known
    configs = configs + [_injector(model)] if injected else configs
    if not calls:
        return None, configs, (False, ())
    recorded, by_call = number_calls(calls)
    shapes, reason = layer_shapes(recorded)
    if reason is not None:
        raise ValueError(f"model type {model_type!r}: {reason}")
    return shapes, configs, (by_call, tuple(sorted(recorded)))


def _stored_shapes(digest: str | None) -> tuple[list, bool] | None:
    """`module_kv_shape`'s (calls, injected) as an earlier process stored them (`verdict_disk`), or None."""
    stored = verdict_disk.load("kv_shapes", digest)
    try:
        calls = [(layer if layer is None else int(layer), tuple(int(n) for n in shape))
                 for layer, shape in stored["calls"]]
        return calls, bool(stored["injected"])
    except (KeyError, TypeError, ValueError):
        return None


def _injector(model: torch.nn.Module) -> ModulePatches:
    return ModulePatches(model, [], keyword_takers(model))


@torch.inference_mode()
def _recorded_shapes(model: torch.nn.Module, configs: list) -> list | None:
    """[(layer index, (K heads, K size, V heads, V size))] as the attention calls of one 2-token forward recorded them
    ([] if none did, None if the forward failed)."""
    shapes: list = []
    device = next(model.parameters()).device
    try:
        with forward_lock(model), attention_implementation(configs, SHAPES_NAME):
            model(input_ids=torch.tensor([[1, 2]], device=device), use_cache=False, hf_paged_kv_shapes=shapes)
    except Exception:  # noqa: BLE001 - a model that cannot run this way is judged by its config and the probe
        return None
    return shapes
