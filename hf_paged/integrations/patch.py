"""The one place hf_paged changes transformers: attention registration, the `generate` take-over, the
text-generation pipeline's `get_iterator` (one engine run per pipeline call), the continuous-batching entry points
(`init_continuous_batching`: integrations/cb_manager.py), the `PreTrainedConfig._attn_implementation` getter (it
answers first from the running thread's switches: model/switches.py) and the mixture experts' grouped product
(`integrations.moe._grouped_mm`: transformers' own outside an engine's forward, model/expert_products.py).
Version-checked and reversible (`enable()` runs on import; `disable()` restores everything)."""
from __future__ import annotations

import functools

from ..config import logger
from .. import model as paged_model
from ..model import fingerprint, switches

SUPPORTED = ((5, 24), (6, 0))  # transformers >= 5.24 (the `cache` argument), < 6
_patched: dict = {}  # what enable() replaced (the original generate, the pipeline's get_iterator); empty when disabled


def _version() -> tuple[int, int]:
    import transformers

    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def enable() -> None:
    """Register the "paged" attention + mask functions, wrap `GenerationMixin.generate` and the text-generation
    pipeline's `get_iterator`. Idempotent."""
    if _patched:
        return
    low, high = SUPPORTED
    version = _version()
    if not low <= version < high:
        raise ImportError(f"hf_paged needs transformers >=5.24,<6; found {'.'.join(map(str, version))}")
    from transformers.generation.utils import GenerationMixin

    from .generate import paged_generate

    original = GenerationMixin.generate

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        return paged_generate(original, self, args, kwargs)

    from transformers import PreTrainedConfig

    _thread_local_config_class(PreTrainedConfig)  # first: it checks what this transformers defines
    paged_model.register()
    GenerationMixin.generate = generate
    _patched["generate"] = original
    _patch_pipeline()
    _patch_continuous_batching()
    switches.set_installer(_thread_local_config_class)


def _thread_local_config_class(config_class: type) -> None:
    """Make `config_class._attn_implementation` answer first from the running thread's switches (what an engine
    switches for its own forward only): the property that class resolves, wherever in its MRO it is defined
    (PreTrainedConfig's, or a subclass's own, such as hrm_text's), keeps its setter and gets a wrapped getter.
    Restored by `disable()`."""
    owner = next((c for c in config_class.__mro__ if "_attn_implementation" in vars(c)), None)
    found = None if owner is None else vars(owner)["_attn_implementation"]
    if not isinstance(found, property) or found.fget is None:
        raise ImportError(f"hf_paged: {config_class.__name__}._attn_implementation is not a property with a getter "
                          f"in this transformers; hf_paged cannot switch attention for one thread")
    if switches.is_thread_local(found.fget):
        return
    setattr(owner, "_attn_implementation",
            property(switches.thread_local_getter(found.fget), found.fset, found.fdel, found.__doc__))
    _patched.setdefault("config_properties", []).append((owner, found))


def _unpatch_config_classes() -> None:
    for owner, original in reversed(_patched.pop("config_properties", [])):
        setattr(owner, "_attn_implementation", original)


def _patch_pipeline() -> None:
    """`TextGenerationPipeline.get_iterator` (inherited from `Pipeline`) -> one engine run when "paged" is asked."""
    from transformers.pipelines.text_generation import TextGenerationPipeline

    from .pipeline import paged_get_iterator

    if not hasattr(TextGenerationPipeline, "_prepare_generate_kwargs"):  # what the engine path reads (5.24)
        logger.warning("hf_paged: this transformers' pipeline lacks _prepare_generate_kwargs; pipelines run batch "
                       "by batch")
        return
    own = TextGenerationPipeline.__dict__.get("get_iterator")  # None: inherited, so disable() deletes ours
    original = TextGenerationPipeline.get_iterator

    @functools.wraps(original)
    def get_iterator(self, inputs, num_workers, batch_size, preprocess_params, forward_params, postprocess_params):
        return paged_get_iterator(original, self, inputs, num_workers, batch_size, preprocess_params, forward_params,
                                  postprocess_params)

    TextGenerationPipeline.get_iterator = get_iterator
    _patched["pipeline_get_iterator"] = own


def _unpatch_pipeline() -> None:
    from transformers.pipelines.text_generation import TextGenerationPipeline

    if "pipeline_get_iterator" not in _patched:
        return
    own = _patched.pop("pipeline_get_iterator")
    if own is None:
        del TextGenerationPipeline.get_iterator
    else:
        TextGenerationPipeline.get_iterator = own


def _patch_continuous_batching() -> None:
    """`ContinuousMixin.init_continuous_batching` (behind `generate_batch` and `continuous_batching_context_manager`)
    and `destroy_cached_continuous_batching_manager` -> hf_paged's manager (integrations/cb_manager.py)."""
    from transformers.generation.continuous_batching.continuous_api import ContinuousMixin

    from .cb_manager import paged_destroy_cached, paged_init_continuous_batching

    init, destroy = ContinuousMixin.init_continuous_batching, ContinuousMixin.destroy_cached_continuous_batching_manager

    @functools.wraps(init)
    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None, workload_hints=None):
        return paged_init_continuous_batching(init, self, generation_config, continuous_batching_config,
                                              workload_hints)

    @functools.wraps(destroy)
    def destroy_cached_continuous_batching_manager(self):
        return paged_destroy_cached(destroy, self)

    ContinuousMixin.init_continuous_batching = init_continuous_batching
    ContinuousMixin.destroy_cached_continuous_batching_manager = destroy_cached_continuous_batching_manager
    _patched["continuous_batching"] = (init, destroy)


def _unpatch_continuous_batching() -> None:
    from transformers.generation.continuous_batching.continuous_api import ContinuousMixin

    if "continuous_batching" in _patched:
        init, destroy = _patched.pop("continuous_batching")
        ContinuousMixin.init_continuous_batching = init
        ContinuousMixin.destroy_cached_continuous_batching_manager = destroy


def disable() -> None:
    """Undo `enable()`: transformers behaves exactly as without hf_paged."""
    if not _patched:
        return
    from transformers.generation.utils import GenerationMixin

    switches.set_installer(None)  # engines now raise HfPagedDisabled, naming hf_paged.enable()
    GenerationMixin.generate = _patched.pop("generate")
    _unpatch_pipeline()
    _unpatch_continuous_batching()
    _unpatch_config_classes()
    paged_model.unregister()
    fingerprint.uninstall()
    logger.debug("hf_paged disabled")


def is_enabled() -> bool:
    return bool(_patched)
