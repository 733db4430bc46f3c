"""Llama-coded decoder layers (Llama's, Mistral's, Qwen2's or Qwen3's attention) of few-row CPU steps in fewer, larger
products (q, k and v in one; gate and up in one; each residual add inside its output product), measured against the
class forward on the machine.

A 64-row decode step of a small model spends much of its time between products: a dozen module calls a layer, each
through `nn.Module.__call__`, seven product dispatches, the residual adds. For a layer whose code is transformers'
Llama layer (`layer_code.llama_parts`) whose seven projections are plain fp32 or bf16 CPU `nn.Linear`s of one dtype
without biases (but q, k and v all with theirs: Qwen2's, added inside the joined product), `fused_layer_forward`
makes the class code's calls of the norms (Qwen3's q / k norms too), the rotary function and the attention function
(with the sliding window Mistral's, Qwen2's and Qwen3's code pass; their forwards: hf_paged's fused norm and rotary
passes where swapped in), and computes the projections from copies of the weights, joined (`LayerCopies`):
h @ [Wq; Wk; Wv]^T in one product, residual + o @ Wo^T in one, h @ [Wgate; Wup]^T in one, act(gate) * up,
residual + that @ Wdown^T (`layer_copies`). fp32 layers: transposed copies, the residual adds inside `addmm`, or —
a third candidate of their trial — the copies packed by oneDNN, as bf16 ones always are (on a Zen 5 EPYC MKL runs its
AVX2 code: a decode step 28.4-30.5 ms on the class forward, 27.4-28.5 fused on oneDNN's). bf16 layers: the joined
weights packed by oneDNN (`torch.ops.mkldnn._reorder_linear_weight`, multiplied as `packed_linear` does: F.linear's
own oneDNN product without a reorder on every call), each residual added to the product rounded to bf16, as the class
code adds it (a 64-row decode layer on a Zen 5 EPYC: 1.92-2.07 ms class, 1.65-1.79 fused). The same sums as the
class forward's, in another order (like any other choice of product); nothing else.

Invariants:
- Only in the engine's forward, in the thread that swapped the forwards in (`THIS_THREAD.fused_layers`), for calls of
  1..MAX_ROWS CPU rows of the weights' dtype in no-grad mode without autocast, `cache` None, no `past_key_values`
  keyword, not training; and only while every part the path skips would only have run its forward
  (`layer_code.plain_calls`, projections included) and the layer's parts are the ones found. Anything else runs the
  class forward.
- The copies are used only while they match their weights, checked as `packed_linear` checks its copies: each
  weight's storage, address, shape, strides and version counter on every call; sample runs of every weight before
  each forward (`Samples.check`: a mismatch drops the model's copies); within packed_linear's memory budget (beyond it:
  the class forward). `LLM.reset_prefix_cache()` drops them too.
- Measured: the first calls of each (hidden, widths, dtype, row bucket, threads) once its projections' own products
  are chosen (`small_linear`: the class forward is then timed as it will run) run the class forward and this one in
  turn (fp32: also the fused one on oneDNN's copies), each call timed whole in the real step (`linear_choice.TABLE`,
  dtype "layer", or "layer bf16"); the class forward stays unless a fused one measured more than 5 % faster. The
  copies of a layout no bucket of the shape chose are dropped. `HF_PAGED_FUSED_LAYERS=0` turns the path off,
  `=force` takes it (on the transposed copies for fp32) wherever it may, untimed (tests).
"""
from __future__ import annotations

import functools
import os
import types
from contextlib import contextmanager

import torch

from .. import trials
from . import layer_code, layer_copies, onednn_linear, packed_linear, read_rows
from .layer_copies import LayerCopies, Samples, copies_for, copyable, forget, layer_shape
from .fused_norms import swapped_forwards
from .linear_choice import BUCKET_OF, TABLE, Key
from .switches import THIS_THREAD

SWITCH = "HF_PAGED_FUSED_LAYERS"
MAX_ROWS = 128
CLASS, FUSED, FUSED_ONEDNN = "class", "fused", "fused_onednn"  # the trial's candidates (the class forward: baseline)
COPYING = frozenset({FUSED, FUSED_ONEDNN})  # those that join copies of the layer's weights (trials.COPY_HOLDERS)


def mode() -> str:
    value = os.environ.get(SWITCH, "auto").strip().lower()
    return {"0": "off", "force": "force"}.get(value, "auto")


def projections(parts: tuple) -> list[torch.nn.Module]:
    attention, mlp = parts[0], parts[1]
    return [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_proj, mlp.up_proj,
            mlp.down_proj]


def _plain_linears(modules: list) -> bool:
    dtype = modules[0].weight.dtype
    return all(type(m) is torch.nn.Linear and copyable(m.weight, dtype) for m in modules) and _biases_plain(modules)


def _biases_plain(modules: list) -> bool:
    """No bias but on q, k and v, and there all three or none, each an fp32 CPU tensor of its output's size (Qwen2's
    attention has them): read where they are on every call, joined for the one product."""
    biases = [m.bias for m in modules]
    if any(b is not None for b in biases[3:]):
        return False
    if all(b is None for b in biases[:3]):
        return True
    return all(b is not None and b.dtype is m.weight.dtype and b.is_cpu and b.dim() == 1
               and b.shape[0] == m.out_features and type(b.data) is torch.Tensor
               for b, m in zip(biases[:3], modules[:3]))


@functools.lru_cache(maxsize=1)
def _attention_lookup() -> tuple:
    """transformers' attention-function registry and the Llama code's default (eager) attention."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward

    return ALL_ATTENTION_FUNCTIONS, eager_attention_forward


def _attend(attention: torch.nn.Module, code: str, qk: tuple, rotary, query, key, value, attention_mask, position_ids,
            use_cache, position_embeddings, kwargs) -> torch.Tensor:
    """The attention code's part between the projections and o_proj (`code`: which of layer_code.ATTENTION_CODES; `qk`:
    Qwen3's q and k norms): q / k / v [B, T, heads * D] -> [B, T, H, D]."""
    hidden_shape = (*query.shape[:-1], -1, attention.head_dim)
    query, key, value = (t.view(hidden_shape) for t in (query, key, value))
    if qk:
        query, key = layer_code.call(qk[0], query), layer_code.call(qk[1], key)
    query, key, value = (t.transpose(1, 2) for t in (query, key, value))
    cos, sin = position_embeddings
    query, key = layer_code.call(rotary, query, key, cos, sin)
    window = {}
    if code == "MistralAttention":
        window["sliding_window"] = getattr(attention.config, "sliding_window", None)
    elif code in ("Qwen2Attention", "Qwen3Attention"):
        window["sliding_window"] = attention.sliding_window
    functions, eager = _attention_lookup()
    interface = functions.get_interface(attention.config._attn_implementation, eager)
    out, _ = interface(attention, query, key, value, attention_mask, dropout=0.0, scaling=attention.scaling, **window,
                       position_ids=position_ids, use_cache=use_cache, **kwargs)
    return out


def _fused(parts: tuple, copies: LayerCopies, hidden_states, attention_mask, position_ids, use_cache,
           position_embeddings, kwargs):
    attention, mlp, norm1, norm2, rotary, code, qk = parts
    nq, nk, ni = copies.widths
    shape = hidden_states.shape
    residual = hidden_states.reshape(-1, shape[-1])
    h = layer_code.call(norm1, hidden_states).reshape(-1, shape[-1])
    q_bias = attention.q_proj.bias
    biases = None if q_bias is None else torch.cat([q_bias, attention.k_proj.bias, attention.v_proj.bias])
    if copies.onednn:  # bf16: as F.linear computes it (oneDNN), the residual added to the rounded product
        qkv = _onednn(h, copies.qkv, biases)
    elif biases is None:
        qkv = torch.mm(h, copies.qkv)
    else:  # as F.linear adds a bias: inside the product
        qkv = torch.addmm(biases, h, copies.qkv)
    qkv = qkv.view(*shape[:-1], -1)
    out = _attend(attention, code, qk, rotary, qkv[..., :nq], qkv[..., nq:nq + nk], qkv[..., nq + nk:],
                  attention_mask, position_ids, use_cache, position_embeddings, kwargs)
    out = out.reshape(residual.shape[0], -1)
    residual = residual + _onednn(out, copies.o) if copies.onednn else torch.addmm(residual, out, copies.o)
    h = layer_code.call(norm2, residual.view(shape)).reshape(-1, shape[-1])
    gate_up = _onednn(h, copies.gate_up) if copies.onednn else torch.mm(h, copies.gate_up)
    act = layer_code.call(mlp.act_fn, gate_up[:, :ni]) * gate_up[:, ni:]
    if copies.onednn:
        return (residual + _onednn(act, copies.down)).view(shape)
    return torch.addmm(residual, act, copies.down).view(shape)


def _onednn(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


def _takes(self, hidden_states, cache, kwargs, dtype: torch.dtype) -> bool:
    shape = hidden_states.shape
    rows = hidden_states.numel() // shape[-1] if hidden_states.dim() and shape[-1] else 0
    return (0 < rows <= MAX_ROWS and cache is None and "past_key_values" not in kwargs and not self.training
            and hidden_states.dtype is dtype and hidden_states.is_cpu and not torch.is_grad_enabled()
            and not torch.is_autocast_enabled("cpu"))


def fused_layer_forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                        position_embeddings=None, **kwargs):
    """The swapped-in forward (module docstring): the fused path where it applies and is chosen, else the class's."""
    found = THIS_THREAD.fused_layers.get(id(self))
    args = (hidden_states, attention_mask, position_ids, use_cache, position_embeddings, kwargs)
    if found is None:
        return _class(self, cache, *args)
    parts, mods, last = found
    rows_read = read_rows.takes(self, hidden_states, cache, kwargs) if last else None
    if rows_read is not None:  # the model's last layer in a step whose head reads fewer rows: only those
        return read_rows.forward_read_rows(self, rows_read, *args)
    if mods is None or not _takes(self, hidden_states, cache, kwargs, mods[0].weight.dtype):
        return _class(self, cache, *args)
    rows = hidden_states.numel() // hidden_states.shape[-1]
    key = Key(layer_shape([m.weight for m in mods]), _key_dtype(mods[0].weight.dtype), BUCKET_OF[rows],
              torch.get_num_threads(), False)
    name = FUSED if mode() == "force" else None
    chosen = TABLE.fast.get(key) if name is None else FUSED
    if chosen == CLASS:
        return _class(self, cache, *args)
    if chosen is None and _projection_trials_open(mods, key.rows):  # theirs first: the class forward timed as it runs
        return _class(self, cache, *args)
    if chosen is None:  # the trial joins the weights of a few layers only (trials.COPY_HOLDERS): the rest run theirs
        name, chosen = TABLE.pick(key, _candidates(mods[0].weight.dtype), holder=id(self), copying=COPYING)
        if name == trials.SKIP:
            return _class(self, cache, *args)
    copies = None if chosen == CLASS else copies_for(self, [m.weight for m in mods], chosen == FUSED_ONEDNN)
    if name is not None and chosen != CLASS and copies is None:  # over the budget: out, this call untimed
        TABLE.record(key, name, float("inf"), baseline=CLASS)
        name, chosen = None, CLASS
    if chosen == CLASS or copies is None:
        run = lambda: _class(self, cache, *args)  # noqa: E731
    else:
        run = lambda: _fused(parts, copies, *args)  # noqa: E731
    if name is None or mode() == "force":
        return run()
    out, decided = TABLE.timed(key, name, run, baseline=CLASS)
    if decided:
        _after_choice(key)
    return out


def _candidates(dtype: torch.dtype) -> dict:
    """The class forward, the fused one on its dtype's copies and, for fp32 where oneDNN packs, on oneDNN's."""
    fused = {CLASS: CLASS, FUSED: FUSED}
    if dtype is torch.float32 and onednn_linear.available() and packed_linear.mode() != "off":
        fused[FUSED_ONEDNN] = FUSED_ONEDNN
    return fused


def _key_dtype(dtype: torch.dtype) -> str:
    """The trial key's dtype: "layer" (fp32, as before) or "layer bf16"."""
    return "layer" if dtype is torch.float32 else "layer bf16"


def _after_choice(key: Key) -> None:
    """Once a bucket's choice is made: the copies of each layout of layers of its shape go unless some bucket of the
    shape chose the fused forward on that layout; where one did, their projections' own copies go (their few-row
    calls do not run)."""
    kept = {chosen for k, chosen in list(TABLE.fast.items()) if k.dtype == key.dtype and k.shape == key.shape}
    for store, variant in ((layer_copies._COPIES, FUSED), (layer_copies._ONEDNN, FUSED_ONEDNN)):
        if variant not in kept:
            with packed_linear._LOCK:
                layers = [layer for layer, c in list(store.items()) if c.shape == key.shape
                          and _key_dtype(c.records[0].dtype) == key.dtype]
            forget(layers, (store,))
    if not kept & {FUSED, FUSED_ONEDNN}:
        return
    same = [mods for _, mods, _ in THIS_THREAD.fused_layers.values() if mods is not None
            and layer_shape([m.weight for m in mods]) == key.shape and _key_dtype(mods[0].weight.dtype) == key.dtype]
    kind = packed_linear.TRANSPOSED if key.dtype == "layer" else None
    packed_linear.forget([m for mods in same for m in mods], (kind,))


def _projection_trials_open(mods: list, bucket: int) -> bool:
    """Whether some projection of the layer still measures its own few-row products for this row bucket."""
    shapes = {m.weight.shape for m in mods}
    return any(key.rows == bucket and key.shape in shapes for key in list(TABLE.trials))


def _class(self, cache, hidden_states, attention_mask, position_ids, use_cache, position_embeddings, kwargs):
    return type(self).forward(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                              cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)


class FusedLayers:
    """The model's Llama-coded decoder layers with plain fp32 CPU projections, and its last layer where `read_rows`
    may skip rows, found once; `active()` is a context for one forward."""

    def __init__(self, model: torch.nn.Module):
        on = mode() != "off"
        found = [(m, p) for m in (model.modules() if on else ()) for p in [layer_code.llama_parts(m)]
                 if p is not None and _plain_linears(projections(p))]
        # per layer: its parts, its projections and everything whose call the fused forward makes directly or skips
        self.found = [(m, p, projections(p), [*p[:5], p[1].act_fn, *projections(p), *p[6]]) for m, p in found]
        self.layers = [m for m, _ in found]
        self.tail = read_rows.last_layer(model) if read_rows.mode() != "off" else None  # (layer, base, norm, ...)
        swapped = self.layers + ([self.tail[0]] if self.tail and self.tail[0] not in self.layers else [])
        self.forwards = {id(m): (m, types.MethodType(fused_layer_forward, m)) for m in swapped}
        self.samples = Samples()

    @contextmanager
    def active(self):
        """The swapped forwards on for one forward pass of this thread: the fused one for the layers whose parts are
        still the ones found (`_unchanged`) and plain (`layer_code.plain_calls`), their copies checked first
        (`Samples`); the last layer's rows read (`read_rows`) where its checks hold."""
        ready = {id(layer): (parts, mods, False) for layer, parts, mods, calls in self.found
                 if _unchanged(layer, parts, mods, calls) and layer_code.plain_calls(calls)}
        tail = self.tail
        if tail is not None and read_rows.unchanged(tail) and layer_code.plain_calls(read_rows.watched(tail)):
            parts, mods, _ = ready.get(id(tail[0]), (None, None, True))
            ready[id(tail[0])] = (parts, mods, True)
        if not ready:
            yield
            return
        before = THIS_THREAD.fused_layers
        THIS_THREAD.fused_layers = {**before, **ready}
        try:
            fused = [m for m in self.layers if ready.get(id(m), (0, None))[1] is not None]
            self.samples.check(fused, [ready[id(m)][1] for m in fused])
            pairs = [pair for key, pair in self.forwards.items() if key in ready]
            with swapped_forwards([m for m, _ in pairs], [f for _, f in pairs], frozenset()):
                yield
        finally:
            THIS_THREAD.fused_layers = before

    def forget(self) -> int:
        return forget(self.layers)


def _unchanged(layer, parts: tuple, mods: list, calls: list) -> bool:
    """The layer still holds the parts found (its projections bias-free plain linears: a weight is checked against
    its copy on every call), and its attention code still calls the same rotary object."""
    attention, mlp, norm1, norm2, rotary, code, qk = parts
    return (layer.self_attn is attention and layer.mlp is mlp and layer.input_layernorm is norm1
            and (not qk or (attention.q_norm is qk[0] and attention.k_norm is qk[1]))
            and layer.post_attention_layernorm is norm2 and mlp.act_fn is calls[5] and projections(parts) == mods
            and all(type(m) is torch.nn.Linear for m in mods) and _biases_plain(mods)
            and layer_code.rotary_call(attention) is rotary)
