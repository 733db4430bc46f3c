"""Take-over of `generate(..., cache_implementation="paged")`.

transformers >= 5.24 reroutes "paged" to its own `generate_batch` before anything else. Our wrapper
sees the request first and runs HF's regular `generate` with a `custom_generate` decoding loop, so HF
still prepares everything (generation config, special tokens, padding mask, `num_return_sequences`
expansion, logits processors, stopping criteria) and only the decoding runs on the engine.
"""
from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Mapping

import torch

from ..config import EngineConfig, InputTypeError, logger
from ..engine import Engine
from ..engine.intake import check_model_len
from .generate_run import GenerateRun
from .in_place import call_reading_in_place, in_place_configs, on_a_paged_cache
from .paged_cache import PagedCache
from ..model import describe_model, position_takers
from ..model.own_state import has_own_state
from ..model.state_modules import find_state_modules, own_cache_class
from ..model.probe import counts_padding
from ..model.signatures import parameter_names

PAGED = "paged"
# model kwargs the engine understands; anything else (images, inputs_embeds, the caller's own position_ids, ...)
# goes to HF's own loop
_ENGINE_MODEL_KWARGS = {"input_ids", "attention_mask", "use_cache", "logits_to_keep", "cache_config"}


def wants_paged(model, options: dict, generation_config=None) -> bool:
    """As HF resolves it: a kwarg, else a passed GenerationConfig's value, else (unset) the model's default."""
    if "cache_implementation" in options:
        return options["cache_implementation"] == PAGED
    for config in (generation_config, model.generation_config):
        value = getattr(config, "cache_implementation", None)
        if value is not None:
            return value == PAGED
    return False


def _set_option(arguments: dict, extra: dict, name: str, value) -> None:
    """Override one generation option for this call only (the caller's objects are not modified)."""
    config = arguments.get("generation_config")
    if config is not None:
        config = copy.deepcopy(config) if not getattr(config, "_hf_paged_copy", False) else config
        setattr(config, name, value)
        config._hf_paged_copy = True
        arguments["generation_config"] = config
        if name in extra:
            extra[name] = value
    else:
        extra[name] = value


def _cache_config(model, arguments: dict, extra: dict, model_max_len: int | None) -> dict | None:
    """The engine options of this call (`cache_config=` or the generation config's), checked up front: anything but a
    dict is an InputTypeError, unknown keys or bad values a ValueError, as for `LLM(...)`."""
    options = extra.get("cache_config")
    if options is None:
        for config in (arguments.get("generation_config"), model.generation_config):
            options = getattr(config, "cache_config", None)
            if options is not None:
                break
    if options is None:
        return None
    if not isinstance(options, Mapping):
        raise InputTypeError(f"cache_config must be a dict of hf_paged engine options (the keys of "
                             f"hf_paged.EngineConfig), got {type(options).__name__}")
    options = dict(options)
    check_model_len(EngineConfig.from_dict(options), model_max_len)
    return options


def _engine_mask_reason(mask: torch.Tensor, windowed: bool, takes_positions: bool) -> str | None:
    """The engine drops padding wherever it is, numbering the real tokens 0.. as HF's position ids do. A row
    ending with padding (right padding) samples its first token from its last pad, as HF does, which needs HF's
    position ids. Padding anywhere but on the left cannot run on the engine with windowed layers whose window is
    shorter than the call (HF's window counts the padding columns inside it)."""
    if not bool(((mask == 0) | (mask == 1)).all()):
        return "the attention mask is not 0/1"
    if not bool((mask != 0).any(dim=-1).all()):
        return "a row of the attention mask has no real token"
    if windowed and not bool((mask[:, 1:] >= mask[:, :-1]).all()):
        return "padding after or between real tokens, with sliding-window layers"
    if not takes_positions and not bool((mask[:, -1] != 0).all()):
        return "a row ends with padding (right padding) and the engine cannot give this model HF's positions for it"
    return None


# config attributes that size a window the engine applies (gpt_neo's local layers: window_size)
_WINDOW_SIZES = ("sliding_window", "attention_chunk_size", "window_size")


def _window_bites(model, span: int | None) -> bool:
    """Whether a sliding window or attention chunk may hide a key within `span` columns (the call's input width plus
    its new tokens; None: unknown). A window at least that long masks nothing, in HF's loop or on the engine."""
    text = model.config.get_text_config(decoder=True)
    sizes = [size for size in (getattr(text, name, None) for name in _WINDOW_SIZES) if isinstance(size, int) and size]
    kinds = {kind for name in ("layer_types", "attention_layers") for kind in (getattr(text, name, None) or [])
             if isinstance(kind, str)} & {"sliding_attention", "chunked_attention", "local"}
    if not sizes:
        return bool(kinds)  # windowed layers of a size we cannot read
    return span is None or min(sizes) <= span


def _takes_positions(model) -> bool:
    """Whether HF's generate hands this model position ids (its own loop does so exactly then) and the engine can
    hand it any: models with a learned position-embedding module (opt, xglm, biogpt) get each token's index in its
    sequence from the engine (`model.position_takers`), which a right-padded row's shifted positions are not."""
    return "position_ids" in parameter_names(model.forward) and not model.config.is_encoder_decoder \
        and not position_takers(model)


def _default_positions(model, inputs, position_ids, mask) -> bool:
    """Caller position ids that are exactly the ones HF derives from the mask (so the engine's are the same)."""
    if not isinstance(position_ids, torch.Tensor) or not isinstance(inputs, torch.Tensor) or inputs.dim() != 2:
        return False
    kwargs = {"attention_mask": mask} if isinstance(mask, torch.Tensor) else {}
    expected = model._prepare_position_ids_for_generation(inputs, kwargs)
    try:
        expected = expected.expand(position_ids.shape)
    except RuntimeError:
        return False
    return bool((position_ids.to(expected.device) == expected).all())


def _token_types_reason(model, token_types, inputs) -> str | None:
    """The engine hands token type ids to the model with the tokens (packed like them). Models that read them as
    more than an embedding (gemma3's mark image tokens, which change the attention mask) run in HF's loop."""
    if not isinstance(token_types, torch.Tensor) or not isinstance(inputs, torch.Tensor) \
            or token_types.shape != inputs.shape or token_types.is_floating_point():
        return "token_type_ids not shaped like input_ids need HF's own loop"
    if model.config.get_text_config(decoder=True).model_type.startswith("gemma3") or \
            getattr(model.config, "vision_config", None) is not None:
        return f"token_type_ids of model type {model.config.model_type!r} need HF's own loop"
    try:  # HF's own loop feeds the model what prepare_inputs_for_generation returns: ctrl's drops the types
        prepared = model.prepare_inputs_for_generation(inputs, token_type_ids=token_types, use_cache=True)
    except Exception:  # noqa: BLE001 - whatever it needs, HF's own loop gives it
        prepared = {}
    if prepared.get("token_type_ids") is None:
        return "token_type_ids that the model's own generate step drops need HF's own loop"
    return None


def _inferred_mask(inputs, config) -> torch.Tensor | None:
    """The mask HF builds when none is passed: padding where the input holds the pad token (unless it is also EOS)."""
    pad, eos = config.pad_token_id, config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if not isinstance(inputs, torch.Tensor) or inputs.dim() != 2 or pad is None or pad in eos:
        return None
    return inputs.ne(pad).long() if bool((inputs == pad).any()) else None


def _hf_loop_reason(model, arguments: dict, extra: dict, config, model_kwargs: dict) -> str | None:
    """Why this call must run in HF's own decoding loop (on a PagedCache); None when the engine can run it.
    `config`, `model_kwargs`: the call's generation config and model inputs as HF resolves them."""
    from transformers.generation.configuration_utils import GenerationMode

    for name in ("assistant_model", "negative_prompt_ids", "custom_generate", "prefix_allowed_tokens_fn"):
        if arguments.get(name) is not None:
            return f"{name} needs HF's own loop"
    if arguments.get("synced_gpus"):
        return "synced_gpus needs HF's own loop"
    mode = config.get_generation_mode(arguments.get("assistant_model"))
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        return f"generation mode {mode.value!r} runs in HF's own loop"
    if config.output_attentions or config.output_hidden_states:
        return "output_attentions / output_hidden_states need HF's own loop"
    if config.token_healing:
        return "token_healing needs HF's own loop"
    inputs = arguments.get("inputs")
    if inputs is None:
        inputs = extra.get("input_ids")
    mask = model_kwargs.get("attention_mask")
    if mask is None:
        mask = _inferred_mask(inputs, config)
    if isinstance(mask, torch.Tensor):
        if mask.dim() != 2:
            return "a custom (not 2D) attention mask needs HF's own loop"
        span = None
        if isinstance(inputs, torch.Tensor) and inputs.dim() == 2:
            new = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - inputs.shape[1]
            span = inputs.shape[1] + max(new, 0)
        reason = _engine_mask_reason(mask, _window_bites(model, span), _takes_positions(model))
        if reason is not None:
            return reason
        if (find_state_modules(model) or has_own_state(model)) and not bool((mask[:, 1:] >= mask[:, :-1]).all()):
            return ("padding after or between real tokens, with state layers (HF's batch feeds that padding through "
                    "their state)")
        if counts_padding(model) and not bool(mask.all()):  # asked on every call with a mask: once per model
            return (f"model type {model.config.model_type!r}: its own forward counts the padding of a padded row in "
                    f"its positions or feeds it through its state (HF's padded batch), which the engine, serving each "
                    f"prompt at its own positions from its first real token, does not reproduce")
    if "position_ids" in model_kwargs and _default_positions(model, inputs, model_kwargs["position_ids"], mask):
        model_kwargs.pop("position_ids")
    known = _ENGINE_MODEL_KWARGS
    if model_kwargs.get("token_type_ids") is not None:
        reason = _token_types_reason(model, model_kwargs["token_type_ids"], inputs)
        if reason is not None:
            return reason
        known = known | {"token_type_ids"}
    odd = sorted(k for k, v in model_kwargs.items() if v is not None and k not in known)
    if odd:
        return f"model inputs {odd} need HF's own loop"
    if not isinstance(inputs, torch.Tensor) or inputs.dim() not in (1, 2) or inputs.is_floating_point():
        return "the engine needs input_ids as a 1D or 2D integer tensor"
    return None


def _run_hf_loop(original, model, spec, arguments: dict, extra: dict, options: dict | None, reason: str):
    """HF's own generate loop with paged memory: a new `PagedCache` (sized by `cache_config`'s block_size /
    num_blocks / kv_cache_memory when given), or the cache the caller passed. On a PagedCache, a model on sdpa
    attention runs "paged_cache" for the call (decodes read the pages in place; see model/cache_attention.py).
    The model's forward lock is held for the call, so that no engine switches its attention meanwhile."""
    arguments.pop("self", None)
    extra.pop("cache_config", None)
    given = extra.get("cache", extra.get("past_key_values"))
    if given is not None:
        where = f"on the cache passed in ({type(given).__name__})"
    elif arguments.get("use_cache", extra.get("use_cache")) is False:
        logger.warning("hf_paged: %s; use_cache=False: transformers' own generate loop without a cache", reason)
        return call_reading_in_place(original, model, arguments, extra, None)
    else:
        _no_paged_cache(model, reason)
        sizes = {k: options[k] for k in ("block_size", "num_blocks", "kv_cache_memory") if options and k in options}
        given = extra["cache"] = PagedCache(model.config, **sizes)
        where = "on a PagedCache"
    configs = in_place_configs(model, spec, arguments, extra) if isinstance(given, PagedCache) else None
    in_place = ", attention reading its pages in place" if configs else ""
    logger.warning("hf_paged: %s; running transformers' own generate loop %s%s", reason, where, in_place)
    return call_reading_in_place(original, model, arguments, extra, configs)


def _no_paged_cache(model, reason: str) -> None:
    """Refuses a call that needs HF's own loop on a PagedCache for a model whose forward accepts only a cache class of
    its own (minimax: its MiniMaxCache holds the lightning-attention layers' states)."""
    own = own_cache_class(model)
    if own is not None:
        raise ValueError(f"model type {model.config.model_type!r}: {reason}, but HF's own loop cannot run it on a "
                         f"PagedCache: its forward accepts only its own cache class {own.__name__} (the paged engine "
                         f"serves it: greedy or sampling on left-padded batches, without options that need HF's loop)")


@functools.lru_cache(maxsize=8)
def _signature(function) -> inspect.Signature:
    return inspect.signature(function)


def paged_generate(original, model, args: tuple, kwargs: dict):
    """The body of the patched `GenerationMixin.generate`."""
    signature = _signature(original)
    bound = signature.bind(model, *args, **kwargs)
    arguments = dict(bound.arguments)
    extra = dict(arguments.pop("kwargs", {}))
    if not wants_paged(model, extra, arguments.get("generation_config")):
        if isinstance(extra.get("cache", extra.get("past_key_values")), PagedCache):
            return on_a_paged_cache(original, model, arguments, extra)
        return original(model, *args, **kwargs)
    spec = describe_model(model)  # unsupported architectures: a clear ValueError, before any work
    options = _cache_config(model, arguments, extra, spec.max_model_len)  # bad options too, even if HF's loop runs
    _set_option(arguments, extra, "cache_implementation", None)
    if extra.get("cache", extra.get("past_key_values")) is not None:
        return _run_hf_loop(original, model, spec, arguments, extra, options, "a cache was passed in")
    probe = {k: v for k, v in extra.items() if k not in ("tokenizer", "assistant_tokenizer")}
    resolved, model_kwargs = model._prepare_generation_config(arguments.get("generation_config"), **probe)
    reason = _hf_loop_reason(model, arguments, extra, resolved, model_kwargs)
    if reason is not None:
        return _run_hf_loop(original, model, spec, arguments, extra, options, reason)
    call = {"streamer": arguments.get("streamer"), "tokenizer": extra.get("tokenizer")}
    if resolved.stop_strings:
        if call["tokenizer"] is None:
            raise ValueError("stop_strings need the tokenizer: pass tokenizer=... to generate")
        from transformers.generation.stopping_criteria import StopStringCriteria, StoppingCriteriaList

        user = arguments.get("stopping_criteria") or StoppingCriteriaList()
        arguments["stopping_criteria"] = StoppingCriteriaList(
            [StopStringCriteria(call["tokenizer"], resolved.stop_strings), *user])
        _set_option(arguments, extra, "stop_strings", None)
    extra.pop("cache_config", None)
    call["cache_config"] = options
    call["spec"] = spec  # the engine takes it as described here (describing again costs ~0.5 ms a call)
    arguments.pop("self", None)
    arguments["custom_generate"] = _paged_decoding_loop
    logger.debug("hf_paged: generate ran on the paged engine")
    return original(model, **arguments, **extra, hf_paged_call=call)


def _paged_decoding_loop(model, input_ids, logits_processor, stopping_criteria, generation_config,
                         hf_paged_call=None, **model_kwargs):
    """Decoding method handed to HF's generate via `custom_generate` (runs after HF's preparation)."""
    call = hf_paged_call or {}
    run = GenerateRun(model, input_ids, model_kwargs.get("attention_mask"), generation_config, logits_processor,
                      stopping_criteria, call.get("streamer"), model_kwargs.get("position_ids"),
                      model_kwargs.get("token_type_ids"))
    engine = Engine(model, None, run.engine_config(call.get("cache_config")), spec=call.get("spec"))
    blocker = run.lockstep_blocker(engine) if run.must_lockstep else None
    if blocker is not None:
        spec, options = engine.spec, call.get("cache_config") or {}
        del engine  # its pool goes before HF's loop allocates its own
        return _own_loop_from_here(model, spec, options, call.get("streamer"), model_kwargs, blocker,
                                   input_ids=input_ids, logits_processor=logits_processor,
                                   stopping_criteria=stopping_criteria, generation_config=generation_config)
    run.run(engine)
    return run.result()


def _own_loop_from_here(model, spec, options: dict, streamer, model_kwargs: dict, blocker: str, **arguments):
    """HF's own decoding loop (`_sample`), taking over where HF's generate handed over to us (the prompt is already
    streamed), on a new PagedCache instead of HF's fresh one, attention reading its pages in place where the model
    allows it, as in `_run_hf_loop`. The pool grows as needed: a pool size the caller chose for the engine (which can
    preempt rows) may not hold HF's batch, which keeps every row at once."""
    if model_kwargs.get("cache") is not None:
        _no_paged_cache(model, f"every row is needed in each step, but {blocker}")
        model_kwargs["cache"] = PagedCache(model.config, block_size=options.get("block_size", 16))
    arguments.update(model_kwargs, streamer=streamer)
    configs = in_place_configs(model, spec, arguments, {})
    in_place = ", attention reading its pages in place" if configs else ""
    logger.warning("hf_paged: sampling, or a logits processor that may keep state or read other rows, needs every row "
                   "in each step, but %s; running transformers' own generate loop on a PagedCache%s", blocker, in_place)
    return call_reading_in_place(lambda m, **kwargs: m._sample(**kwargs), model, arguments, {}, configs)
