"""The K/V shapes a model's attention layers produce, and how each layer's K / V / queries are fitted to its pages.

Read once per model from one 2-token forward through `record_kv_shapes`: {layer: (K heads, K size, V heads, V size)}
(a "layer" of the KV cache is a call of the attention function: `number_calls`).
Layers may differ (mimo_v2_flash: sliding layers have twice the K/V heads of full ones): each layer's pages take its
own shape (kv/cache.py). K and V of one layer may differ in head size (mimo_v2_flash: K 192, V 128): its pages hold
both at the larger size, the smaller zero-padded, and the query padded as K is. That is exact: a zero-padded K column
adds q * 0 = 0 to every score, and the output's padded V columns are zeros that are cut off again
(`fit_to_pages` / `cut_to_value`); the softmax scale is the caller's (or 1/sqrt(K size), never the padded size's).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kv import KVCacheSpec


def record_kv_shapes(module, query, key, value, attention_mask, *args, hf_paged_kv_shapes=None, **kwargs):
    """An attention function that only records what each call produces: (the module's layer index, (K heads, K size,
    V heads, V size)) appended to the `hf_paged_kv_shapes` list passed down the forward's keywords; returns zeros of
    the output's shape. Used once per model by `spec.describe_model` (the KV cache is shaped by what the modules
    produce)."""
    if hf_paged_kv_shapes is not None:
        hf_paged_kv_shapes.append((getattr(module, "layer_idx", None),
                                   (key.shape[1], key.shape[3], value.shape[1], value.shape[3])))
    batch, num_heads, length, _ = query.shape
    return query.new_zeros(batch, length, num_heads, value.shape[3]), None


def number_calls(calls: list[tuple[int | None, tuple]]) -> tuple[dict[int, tuple], bool]:
    """({stored layer: shape}, by_call) from the calls `record_kv_shapes` saw in one forward. Each call's K/V is kept
    under its module's layer index when every call has one of its own; otherwise (zamba: one attention block shared
    by several layers, `layer_idx` None; diffllama: two calls per layer, with the same K and different V) under the
    call's place in the forward, the same in every forward (`by_call`)."""
    layers = [layer for layer, _ in calls]
    if None not in layers and len(set(layers)) == len(layers):
        return dict(calls), False
    return {index: shape for index, (_, shape) in enumerate(calls)}, True


def layer_shapes(recorded: dict[int, tuple[int, int, int, int]]) -> tuple[dict[int, tuple[int, int, int]], str | None]:
    """({layer: (heads, K size, V size)}, None) from what `record_kv_shapes` recorded, or ({}, why not) when a layer's
    K and V have different numbers of heads (pages hold one count for both)."""
    shapes = {}
    for layer, (k_heads, k_size, v_heads, v_size) in sorted(recorded.items()):
        if k_heads != v_heads:
            return {}, (f"layer {layer} produces K with {k_heads} heads but V with {v_heads}; hf_paged's pages hold "
                        f"K and V with one number of heads")
        shapes[layer] = (k_heads, k_size, v_size)
    return shapes, None


def page_mismatch(spec: KVCacheSpec, layer: int, key: torch.Tensor, value: torch.Tensor) -> str | None:
    """Why key / value [1, heads, T, size] of `layer` do not fit its pages (they differ from the shape recorded at
    start), None when they do."""
    heads, k_size, v_size = spec.kv_shape(layer)
    if key.shape[1] == value.shape[1] == heads and key.shape[3] == k_size and value.shape[3] == v_size:
        return None
    return (f"layer {layer} produces K/V with {key.shape[1]} / {value.shape[1]} heads of size {key.shape[3]} / "
            f"{value.shape[3]}, but its pages hold {heads} heads of size {k_size} / {v_size}")


def fit_to_pages(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 scaling: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float | None]:
    """query / key / value [..., size] with K and V at one head size (the smaller zero-padded, the query as K), and
    the softmax scale of the unpadded K. Returns the inputs themselves when K and V sizes agree."""
    k_size, v_size = key.shape[-1], value.shape[-1]
    if k_size == v_size:
        return query, key, value, scaling
    scaling = k_size ** -0.5 if scaling is None else scaling
    if k_size < v_size:
        return F.pad(query, (0, v_size - k_size)), F.pad(key, (0, v_size - k_size)), value, scaling
    return query, key, F.pad(value, (0, k_size - v_size)), scaling


def cut_to_value(out: torch.Tensor, v_size: int) -> torch.Tensor:
    """The attention output [..., padded size] cut back to the V head size."""
    return out if out.shape[-1] == v_size else out[..., :v_size]
