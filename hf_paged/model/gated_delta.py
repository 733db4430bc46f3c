"""The gated delta rule (Gated DeltaNet) and the short convolution before it, in fewer passes over memory than
transformers' torch reference code: drop-in replacements for its `torch_recurrent_gated_delta_rule`,
`torch_chunk_gated_delta_rule` and `causal_conv1d_forward` (same arguments, same results up to float rounding), each
made from the function it replaces (`original`), which it calls for anything it does not cover.

- `recurrent_step` (a single token from a state: every decode): transformers decays the state, multiplies it by k
  and sums, adds an outer product, multiplies by q and sums, each a new state-sized tensor (about a dozen passes over
  a state of heads x key dim x value dim floats per sequence). Here one batched matmul reads the state once for both
  q S and k S; the state is then decayed and updated in place (two passes): out = decay (q S) + (q . k) delta equals
  q (decay S + k delta^T). The state it is given is updated in place (the caller's `StateView` owns it).
- `chunk_rule` (several tokens: prefills, chunks): where the native steps are built, the recurrent form token by
  token in native code (`gdn_seq_f32`): per token the same multiply-adds on the state as the chunked form's state
  products, but each head's state stays in cache from token to token where the chunked form passes every
  sequence's state through memory once per chunk (3-7x transformers' chunked code on one EPYC thread, prompts of
  16-1,000 tokens, 4-32 heads of 64-128). Otherwise the chunked form with every tensor laid out chunk-major
  [chunks, batch, heads, chunk, dim] in one copy per input (each chunk's slice contiguous for the scan over
  chunks), both triangular solves as one, and a chunk size of `CHUNK` tokens (64 in transformers: the intra-chunk
  work per token grows with the chunk, the scan's steps shrink).
- `conv_step` (a single token from a stored window on a `StateView`): the new window (the stored one shifted by the
  token) becomes the state and its products with the kernel the output; natively for fp32 and bf16 windows (bf16:
  what a bf16 convolution and SiLU give, bit for bit).
Natively, a token's output and the state after it are the same bits whether decode steps or a prefill compute them
(the sequence kernels run the step's code, or sum in its order): a request recomputed after preemption continues
exactly where it was.
"""
from __future__ import annotations

import torch

import ctypes
import functools
from pathlib import Path

from .. import native
from .state_layers import StateView

CHUNK = 16
SOURCE = Path(__file__).with_name("cpu") / "gated_delta.c"
ACTIVATIONS = {None: 0, "silu": 1, "swish": 1}  # the convolution's activations the native step computes


class NativeSteps:
    """`gdn_step_f32`, `gdn_seq_f32`, `conv_step_f32`, `conv_step_bf16` and `conv_seq_f32` of cpu/gated_delta.c
    (contiguous CPU tensors of their dtype; callers check)."""

    def __init__(self, path: Path):
        library = ctypes.CDLL(str(path))
        ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        self.gdn, self.conv, self.conv_seq = library.gdn_step_f32, library.conv_step_f32, library.conv_seq_f32
        self.gdn_seq, self.conv_bf16 = library.gdn_seq_f32, library.conv_step_bf16
        self.gdn.argtypes = [ptr] * 7 + [i64] * 6 + [f32]
        self.gdn_seq.argtypes = [ptr] * 7 + [i64] * 7 + [f32]
        self.conv.argtypes = self.conv_bf16.argtypes = [ptr] * 5 + [i64] * 4
        self.conv_seq.argtypes = [ptr] * 4 + [i64] * 6
        self.gdn.restype = self.gdn_seq.restype = self.conv.restype = self.conv_bf16.restype = None
        self.conv_seq.restype = None


@functools.lru_cache(maxsize=1)
def native_steps() -> NativeSteps | None:
    """The native steps, built on first use (None without a compiler, or with HF_PAGED_GATED_DELTA_KERNEL=0)."""
    return native.load(SOURCE, "HF_PAGED_GATED_DELTA_KERNEL", NativeSteps)[0]


def _native_ready(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def recurrent_step(original):
    """transformers' `torch_recurrent_gated_delta_rule` for one token from a float32 state (see the module doc)."""
    @torch.compiler.disable  # calls native code through raw pointers: never traced by dynamo (a compiled model)
    def step(query, key, value, g, beta, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, **kwargs):
        if initial_state is None or query.shape[1] != 1 or initial_state.dtype != torch.float32:
            return original(query, key, value, g=g, beta=beta, initial_state=initial_state,
                            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            **kwargs)
        dtype = query.dtype
        num_k_heads, k_dim = key.shape[-2:]
        num_v_heads, v_dim = value.shape[-2:]
        steps = native_steps()
        if steps is not None and num_v_heads % num_k_heads == 0:
            q, k, v = (x[:, 0].float().contiguous() for x in (query, key, value))
            decay, rate = (x[:, 0].float().contiguous() for x in (g, beta))
            if _native_ready(initial_state, q, k, v, decay, rate):
                out = torch.empty_like(v)
                steps.gdn(initial_state.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), decay.data_ptr(),
                          rate.data_ptr(), out.data_ptr(), q.shape[0], num_k_heads, num_v_heads, k_dim, v_dim,
                          int(bool(use_qk_l2norm_in_kernel)), k_dim ** -0.5)
                return out[:, None].to(dtype), (initial_state if output_final_state else None)
        if num_k_heads != num_v_heads:  # grouped: each query/key head serves consecutive value heads
            query = query.repeat_interleave(num_v_heads // num_k_heads, dim=2)
            key = key.repeat_interleave(num_v_heads // num_k_heads, dim=2)
        query, key, value = (x[:, 0].float() for x in (query, key, value))  # [B, H, D]
        if use_qk_l2norm_in_kernel:
            query, key = _l2norm(query), _l2norm(key)
        query = query / (k_dim ** 0.5)
        decay = g[:, 0].float().exp()[..., None]  # [B, H, 1]
        state = initial_state  # [B, H, K, V]
        both = torch.matmul(torch.stack((query, key), dim=2), state)  # [B, H, 2, V]: q S and k S
        delta = (value - both[:, :, 1] * decay) * beta[:, 0].float()[..., None]  # [B, H, V]
        state.mul_(decay[..., None])
        state.view(-1, k_dim, v_dim).baddbmm_(key.reshape(-1, k_dim, 1), delta.reshape(-1, 1, v_dim))
        out = both[:, :, 0] * decay + (query * key).sum(-1, keepdim=True) * delta
        return out[:, None].to(dtype), (state if output_final_state else None)
    return step


def chunk_rule(original, chunk: int = CHUNK):
    """transformers' `torch_chunk_gated_delta_rule` on CPU tensors (see the module doc); `original` elsewhere."""
    def rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, **kwargs):
        if query.device.type != "cpu" or kwargs.get("cu_seqlens") is not None:
            return original(query, key, value, g=g, beta=beta, chunk_size=chunk_size, initial_state=initial_state,
                            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            **kwargs)
        dtype = query.dtype
        batch, length, num_k_heads, k_dim = key.shape
        num_v_heads, v_dim = value.shape[-2:]
        steps = native_steps()
        if steps is not None and num_v_heads % num_k_heads == 0 and query.shape == key.shape:
            return _native_sequence(steps, query, key, value, g, beta, initial_state, output_final_state,
                                    use_qk_l2norm_in_kernel)
        chunks = -(-length // chunk)

        def laid_out(x: torch.Tensor) -> torch.Tensor:
            """[B, L, h, ...] as float32 [N, B, H, C, ...] (h heads each serving H / h consecutive heads), zero past
            the end: one copy."""
            x = x if x.dim() == 4 else x[..., None]
            group = num_v_heads // x.shape[2]
            laid = torch.empty((chunks, batch, num_v_heads, chunk, x.shape[-1]), dtype=torch.float32)
            target = laid.view(chunks, batch, x.shape[2], group, chunk, x.shape[-1]).permute(1, 0, 4, 2, 3, 5)
            full = length // chunk * chunk
            target[:, :length // chunk].copy_(x[:, :full].reshape(batch, -1, chunk, x.shape[2], 1, x.shape[-1]))
            if full < length:
                target[:, -1, :length - full].copy_(x[:, full:, :, None])
                target[:, -1, length - full:].zero_()
            return laid

        query, key, value = (laid_out(x) for x in (query, key, value))  # [N, B, H, C, D]
        beta, decay = (laid_out(x)[..., 0] for x in (beta, g))  # [N, B, H, C]
        if use_qk_l2norm_in_kernel:
            query, key = _l2norm(query), _l2norm(key)
        query = query * k_dim ** -0.5
        cum = decay.cumsum(-1)
        # transposed [N, B, H, C, C]: pairwise[i, j] = exp(cum_i - cum_j) for j <= i, else 0, stored as its
        # transpose so that the triangular solve (LAPACK: column-major) takes it without a copy
        pairwise = (cum[..., None, :] - cum[..., :, None]).masked_fill_(
            torch.ones(chunk, chunk, dtype=torch.bool).tril_(-1), float("-inf")).exp_().mT
        k_beta = key * beta[..., None]
        system = (key @ k_beta.mT).mul_(pairwise.mT).mT  # k_beta k^T, decayed (column-major)
        right = torch.cat(((value * beta[..., None]).mT, (k_beta * cum.exp()[..., None]).mT), dim=-2).mT
        solved = torch.linalg.solve_triangular(system, right, upper=False, unitriangular=True)
        new_values, k_decayed = solved[..., :v_dim], solved[..., v_dim:]
        inner = (key @ query.mT).mul_(pairwise.mT).mT  # q k^T, decayed
        query = query * cum.exp()[..., None]
        key = key * (cum[..., -1:] - cum).exp()[..., None]
        chunk_decay = cum[..., -1].exp()[..., None, None]  # [N, B, H, 1, 1]
        state = (initial_state.float().clone() if initial_state is not None
                 else query.new_zeros((batch, num_v_heads, k_dim, v_dim)))
        out = torch.empty((chunks, batch, num_v_heads, chunk, v_dim), dtype=torch.float32)
        flat = (-1, chunk, v_dim)
        for i in range(chunks):
            fresh = new_values[i] - k_decayed[i] @ state
            torch.baddbmm((query[i] @ state).view(flat), inner[i].reshape(-1, chunk, chunk), fresh.view(flat),
                          out=out[i].view(flat))
            state = state * chunk_decay[i] + key[i].mT @ fresh
        out = out.movedim(0, 1).movedim(2, 3).reshape(batch, chunks * chunk, num_v_heads, v_dim)[:, :length]
        return out.to(dtype), (state if output_final_state else None)
    return rule


@torch.compiler.disable  # native code through raw pointers: never traced by dynamo (a compiled model)
def _native_sequence(steps: NativeSteps, query, key, value, g, beta, initial_state, output_final_state, l2norm):
    """The chunk rule's result by `gdn_seq_f32` (token by token from the state, each head's state kept in cache): on
    float32 contiguous copies of the inputs and of the initial state (the caller's is left as it is)."""
    batch, length, num_k_heads, k_dim = key.shape
    num_v_heads, v_dim = value.shape[-2:]
    q, k, v, decay, rate = (x.float().contiguous() for x in (query, key, value, g, beta))
    state = (initial_state.float().clone(memory_format=torch.contiguous_format) if initial_state is not None
             else q.new_zeros((batch, num_v_heads, k_dim, v_dim)))
    out = torch.empty_like(v)
    steps.gdn_seq(state.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), decay.data_ptr(), rate.data_ptr(),
                  out.data_ptr(), batch, length, num_k_heads, num_v_heads, k_dim, v_dim, int(bool(l2norm)),
                  k_dim ** -0.5)
    return out.to(query.dtype), (state if output_final_state else None)


def _conv_kernel(steps: NativeSteps, *tensors: torch.Tensor | None):
    """The native convolution step for these tensors (window, token, weight, bias or None): fp32 or bf16, all one
    dtype, contiguous on the CPU; None for anything else."""
    given = [t for t in tensors if t is not None]
    if any(t.device.type != "cpu" or not t.is_contiguous() or t.dtype != given[0].dtype for t in given):
        return None
    return {torch.float32: steps.conv, torch.bfloat16: steps.conv_bf16}.get(given[0].dtype)


def conv_step(original):
    """transformers' `causal_conv1d_forward` on a `StateView`: one token from a stored window (see the module doc),
    or several tokens natively (the view's window, then the convolution over it); `original` for anything else."""
    @torch.compiler.disable  # calls native code through raw pointers: never traced by dynamo (a compiled model)
    def step(conv1d, hidden_states, cache, layer_idx, activation=None, state_idx=0, **kwargs):
        weight, steps, bias = conv1d.weight.squeeze(1), native_steps(), conv1d.bias  # weight [C, K]
        if not isinstance(cache, StateView):
            return original(conv1d, hidden_states, cache, layer_idx, activation=activation, state_idx=state_idx,
                            **kwargs)
        previous = cache.get_conv_state(layer_idx, state_idx) if hidden_states.shape[-1] == 1 else None
        if previous is None:
            if (steps is None or activation not in ACTIVATIONS or kwargs
                    or not _native_ready(weight, *([] if bias is None else [bias]))
                    or hidden_states.dtype != torch.float32):
                return original(conv1d, hidden_states, cache, layer_idx, activation=activation,
                                state_idx=state_idx, **kwargs)
            length = hidden_states.shape[-1]  # several tokens (or a first one): the window, then the convolution
            full = cache.update_conv_state(hidden_states, layer_idx, state_idx=state_idx,
                                           conv_kernel_size=weight.shape[-1]).mT.contiguous()  # [B, T, C]
            out, taps = full.new_empty((full.shape[0], length, full.shape[2])), weight.t().contiguous()  # (held)
            steps.conv_seq(full.data_ptr(), taps.data_ptr(), 0 if bias is None else bias.data_ptr(),
                           out.data_ptr(), full.shape[0], full.shape[2], full.shape[1], weight.shape[-1], length,
                           ACTIVATIONS[activation])
            return out.mT  # [B, C, S], channels last in memory (as the module's own transposed input came)
        x = hidden_states[..., 0].contiguous()
        native = None if steps is None or activation not in ACTIVATIONS or previous.shape[-1] != weight.shape[-1] \
            else _conv_kernel(steps, previous, x, weight, bias)
        if native is not None:
            out = torch.empty_like(x)
            native(previous.data_ptr(), x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
                   out.data_ptr(), x.shape[0], x.shape[1], weight.shape[-1], ACTIVATIONS[activation])
            cache.values[("conv", state_idx)] = previous  # shifted in place
            return out[..., None]
        window = torch.cat((previous[..., 1:], hidden_states.to(previous.dtype)), dim=-1)  # [B, C, K]
        cache.values[("conv", state_idx)] = window
        # summed in fp32 (a convolution accumulates in fp32 whatever its inputs' dtype), then in the weight's dtype
        out = (window.to(weight.dtype).float() * weight.float()).sum(-1, keepdim=True)
        if conv1d.bias is not None:
            out = out + conv1d.bias.float()[:, None]
        out = out.to(weight.dtype)
        if activation is not None:
            from transformers.activations import ACT2FN

            out = ACT2FN[activation](out)
        return out.to(hidden_states.dtype)
    return step
