"""The one place hf_paged changes transformers: attention registration, the `generate` take-over and the
text-generation pipeline's `get_iterator` (one engine run per pipeline call).
Version-checked and reversible (`enable()` runs on import; `disable()` restores everything)."""
from __future__ import annotations

import functools

from ..config import logger
from .. import model as paged_model

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

    paged_model.register()
    GenerationMixin.generate = generate
    _patched["generate"] = original
    _patch_pipeline()


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


def disable() -> None:
    """Undo `enable()`: transformers behaves exactly as without hf_paged."""
    if not _patched:
        return
    from transformers.generation.utils import GenerationMixin

    GenerationMixin.generate = _patched.pop("generate")
    _unpatch_pipeline()
    paged_model.unregister()
    logger.debug("hf_paged disabled")


def is_enabled() -> bool:
    return bool(_patched)
