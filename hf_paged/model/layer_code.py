"""Which decoder layers run transformers' Llama layer code (with Llama's, Mistral's, Qwen2's or Qwen3's attention
code), and what a direct call of their parts may skip.

`fused_layers` computes such a layer's forward itself. That is only the layer's own computation where:
- the layer's class, its attention's class and its MLP's class have exactly the code of transformers'
  LlamaDecoderLayer / LlamaAttention (or Mistral's, Qwen2's, Qwen3's) / LlamaMLP forwards (bytecode, constants,
  names; under their decorators), its norms (and Qwen3's q / k norms) RMSNorm-coded (`fused_norms.is_llama_rms_norm`),
  and the installed transformers' code is the one `fused_layers` was written against (`KNOWN_SOURCES`: a hash of each
  forward's source; another transformers version turns the path off until it is checked and the hashes updated);
- `module(...)` would only call `module.forward(...)` for every part it calls directly (`plain_calls`: no forward /
  backward (pre-)hooks on them nor global ones, no compiled call, no tracing: nn.Module._call_impl's own test);
- the attention code's `apply_rotary_pos_emb(...)` resolves to one known object (`rotary_call`): the attention
  module's private wrapper, where `kernels` routes the global function (its per-call context variable does only
  that), or the global function itself.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import types

import torch

from .fused_norms import _same_code, is_llama_rms_norm

# sha256 (first 16 hex digits) of each unwrapped forward's source (stripped lines, decorators left out): transformers
# 5.25's, which fused_layers' and read_rows' forwards mirror or rely on
KNOWN_SOURCES = {"LlamaDecoderLayer": "f71062a878a1e9a8", "LlamaAttention": "188c5c14bdfa4bc9",
                 "LlamaMLP": "1923407024d5de0b", "LlamaForCausalLM": "9b1e78989284c360",
                 "MistralAttention": "723ed076636398a0", "Qwen2Attention": "9c0d7936d42c57f3",
                 "Qwen3Attention": "6de7f1c9e04d6f3d"}
# the attention codes fused_layers mirrors (Llama's; Mistral's and Qwen2's pass a sliding window; Qwen3's norms q and k
# per head first and passes its sliding window), and the transformers module each is defined in
ATTENTION_CODES = {"LlamaAttention": "llama", "MistralAttention": "mistral", "Qwen2Attention": "qwen2",
                   "Qwen3Attention": "qwen3"}
ROTARY = "apply_rotary_pos_emb"  # the global name the attention code calls


def source_hash(function) -> str:
    lines = (line.strip() for line in inspect.getsource(function).splitlines())
    body = "\n".join(line for line in lines if line and not line.startswith("@"))
    return hashlib.sha256(body.encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def references() -> dict | None:
    """name -> the unwrapped code of transformers' Llama forwards, or None where their source is not the known one."""
    import importlib

    found = {}
    for name, known in KNOWN_SOURCES.items():
        module = ATTENTION_CODES.get(name, "llama")
        modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
        function = inspect.unwrap(getattr(modeling, name).forward)
        try:
            if source_hash(function) != known:
                return None
        except (OSError, TypeError):
            return None
        found[name] = function.__code__
    return found


def code_is(cls, name: str, docstring: bool = True) -> bool:
    """Whether `cls.forward` (under its decorators) has the code of transformers' Llama forward `name` (with
    `docstring=False`: but for its docstring, which names the model in its example)."""
    forward = getattr(cls, "forward", None)
    code = getattr(inspect.unwrap(forward), "__code__", None) if forward is not None else None
    if code is None:
        return False
    reference = references()[name]
    return _same_code(code, reference) if docstring else _undocumented(code) == _undocumented(reference)


def _undocumented(code) -> tuple:
    consts = code.co_consts[1:] if code.co_consts and isinstance(code.co_consts[0], str) else code.co_consts
    return code.co_code, consts, code.co_names, code.co_varnames


@functools.lru_cache(maxsize=None)
def _unwrapped(forward):
    return inspect.unwrap(forward)


def rotary_call(attention: torch.nn.Module):
    """What the attention code's `apply_rotary_pos_emb(...)` runs: the module's private wrapper (a module), or the
    global function itself where it is a plain function (looked up now: a patched global counts); None: neither."""
    function = _unwrapped(type(attention).forward).__globals__.get(ROTARY)
    name = getattr(function, "kernel_layer_name", None)
    if name is None:
        return function if isinstance(function, types.FunctionType) else None
    wrappers = vars(attention).get("_kernel_funcs")
    found = wrappers.get(getattr(function, "__name__", None) or name) if isinstance(wrappers, dict) else None
    return found if isinstance(found, torch.nn.Module) else None


def attention_code(attention: torch.nn.Module) -> str | None:
    """Which of the ATTENTION_CODES the module's class runs (Qwen3's: with RMSNorm-coded q / k norms), else None."""
    code = next((name for name in ATTENTION_CODES if code_is(type(attention), name)), None)
    if code == "Qwen3Attention" and not all(isinstance(n, torch.nn.Module) and is_llama_rms_norm(n)
                                            for n in (getattr(attention, "q_norm", None),
                                                      getattr(attention, "k_norm", None))):
        return None
    return code


def llama_parts(layer: torch.nn.Module) -> tuple | None:
    """(attention, mlp, input norm, post-attention norm, rotary, attention code, (q norm, k norm) or ()) of a decoder
    layer with Llama's layer and MLP code and one of the ATTENTION_CODES, else None."""
    if references() is None or not code_is(type(layer), "LlamaDecoderLayer"):
        return None
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)
    code = attention_code(attention) if isinstance(attention, torch.nn.Module) else None
    if not (code is not None and isinstance(mlp, torch.nn.Module) and code_is(type(mlp), "LlamaMLP")
            and all(isinstance(n, torch.nn.Module) and is_llama_rms_norm(n) for n in norms)):
        return None
    rotary = rotary_call(attention)
    qk = (attention.q_norm, attention.k_norm) if code == "Qwen3Attention" else ()
    return None if rotary is None else (attention, mlp, *norms, rotary, code, qk)


def plain_calls(modules: list) -> bool:
    """`module(...)` would only call `module.forward(...)` for each module among them (nn.Module._call_impl's own
    test; plain functions are called as they are)."""
    hooks = torch.nn.modules.module
    if (hooks._global_backward_pre_hooks or hooks._global_backward_hooks or hooks._global_forward_hooks
            or hooks._global_forward_pre_hooks or torch._C._get_tracing_state()):
        return False
    return not any(isinstance(m, torch.nn.Module)
                   and (m._backward_hooks or m._backward_pre_hooks or m._forward_hooks or m._forward_pre_hooks
                        or m._compiled_call_impl is not None) for m in modules)


def call(target, *args):
    """`target(*args)` for a module `plain_calls` cleared (its forward), or a plain function."""
    return target.forward(*args) if isinstance(target, torch.nn.Module) else target(*args)
