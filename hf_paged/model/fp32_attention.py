"""The model's own forward with its own attention function computed in float32: the start-up check's second
reference for bf16 / fp16 models.

hf_paged's attention of a half-precision model sums in float32 (SDPA's CPU path, the explicit scores, the native
kernels), where a model's eager attention rounds its scores and probabilities to bf16 first. Both are the model up to
rounding, yet a model whose next layers amplify rounding (a mixture of experts: a router's top-k flips between two
near-equal experts) can part from its own bf16 forward by far more than the check's tolerance. A random gpt-oss-shaped
model (hidden 512, 8 layers, 8 experts, bf16) did: its paged logits stood 0.14-0.29 of the largest logit from its own
forward's, 0.0-0.004 from its own forward with this float32 attention, and its own bf16 forward stood 0.25 from its
float32 one at one step. `probe` asks this reference only when the first one disagrees, and says so.

Invariants:
- Registered with transformers (`register` / `unregister`, from `hf_paged.enable()` / `disable()`) under NAMES, one per
  attention implementation it wraps ("eager": the model's module-level `eager_attention_forward`; "sdpa":
  transformers' `sdpa_attention_forward`), each with that implementation's mask function. Nothing else reads them.
- `float32_attention(configs)` switches the configs' attention to the wrapper of their own implementation in this
  thread only (`switches.switched_attention`); `NoReference` where the implementation is neither (or the model's
  module has no eager function): the check then keeps its first verdict.
- The wrapper runs the very function the model runs, on query / key / value (and a floating mask) cast to float32,
  and casts the output back to the query's dtype: the model's own attention, only summed in float32.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

from .switches import switched_attention

NAMES = {"eager": "hf_paged_float32_eager", "sdpa": "hf_paged_float32_sdpa"}


class NoReference(RuntimeError):
    """The model's attention is not one this reference can run in float32."""


def _upcast(function, module, query, key, value, attention_mask, **kwargs):
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    out, weights = function(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
    return out.to(query.dtype), weights


def eager_float32(module, query, key, value, attention_mask, **kwargs):
    function = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if function is None:
        raise NoReference(f"{type(module).__name__}'s module has no eager_attention_forward")
    return _upcast(function, module, query, key, value, attention_mask, **kwargs)


def sdpa_float32(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return _upcast(sdpa_attention_forward, module, query, key, value, attention_mask, **kwargs)


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    for implementation, function in (("eager", eager_float32), ("sdpa", sdpa_float32)):
        AttentionInterface.register(NAMES[implementation], function)
        AttentionMaskInterface.register(NAMES[implementation], ALL_MASK_ATTENTION_FUNCTIONS[implementation])


def unregister() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for name in NAMES.values():
        AttentionInterface._global_mapping.pop(name, None)
        AttentionMaskInterface._global_mapping.pop(name, None)


@contextmanager
def float32_attention(configs: list):
    """Inside, in this thread, the configs' attention (one implementation, eager or sdpa) sums in float32."""
    configs = [c for c in configs if isinstance(getattr(c, "_attn_implementation", None), str)]
    names = {c._attn_implementation for c in configs}
    if len(names) != 1 or next(iter(names)) not in NAMES:
        raise NoReference(f"attention {sorted(names)}: no float32 reference")
    with switched_attention(configs, NAMES[next(iter(names))]):
        yield
