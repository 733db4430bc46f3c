"""The one place hf_paged changes transformers: attention registration and the `generate` take-over.
Version-checked and reversible (`enable()` runs on import; `disable()` restores everything)."""
from __future__ import annotations

import functools

from ..config import logger
from .. import model as paged_model

SUPPORTED = ((5, 24), (6, 0))  # transformers >= 5.24 (the `cache` argument), < 6
_patched: dict = {}  # the original generate while enabled; empty when disabled


def _version() -> tuple[int, int]:
    import transformers

    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def enable() -> None:
    """Register the "paged" attention + mask functions and wrap `GenerationMixin.generate`. Idempotent."""
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


def disable() -> None:
    """Undo `enable()`: transformers behaves exactly as without hf_paged."""
    if not _patched:
        return
    from transformers.generation.utils import GenerationMixin

    GenerationMixin.generate = _patched.pop("generate")
    paged_model.unregister()
    logger.debug("hf_paged disabled")


def is_enabled() -> bool:
    return bool(_patched)
