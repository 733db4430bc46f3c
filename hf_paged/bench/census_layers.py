"""How many layers the model census (models_census.py) builds each model type with, and the layer pattern.

A transformer of attention layers only is built with 2 layers when its first 2 layers hold every layer type of its
full-size default config (all of a plain one; gemma2's sliding / full alternation). A stack with other layer types
(linear attention / state-space / conv / hybrid layers, usually with attention every k-th layer), or whose first 2
layers miss a type (sliding layers with a full one every k-th, dense and MoE MLPs, ...), is built with the smallest
N >= 4 whose layer pattern holds every layer type of its full-size default config. The pattern for N layers is the
config class's own: its config is rebuilt with N layers (so `layer_types`, `layers_block_type`, `mlp_layer_types`,
`hybrid_layer_ids`, `per_layer_config`, ... are derived by the class, as for a checkpoint of N layers); a class that
cannot derive it (it keeps a stored per-layer list of the full length) gets its per-layer lists cut to the first N
and its layer-index lists filtered to < N. A model that cannot be built with that N (zamba: its block shared between
hybrid layers needs two of them) is tried with the smallest N that holds each type twice, then three times.

"Layer types" are the values of the config's per-layer string lists: every list (or tuple) of strings of the
layer count's length among its attributes, plus its `layer_types` (often a property or an alias of
`layers_block_type`). A few families' default configs hold no hybrid pattern at all (every layer a state layer, or
every layer attention, or none given): REPRESENTATIVE gives those the pattern their published models use, cut the
same way.
"""
from __future__ import annotations

PLAIN = 2  # layers of a plain transformer (and of a stack whose first 2 layers already hold each layer type)
MIXED = 4  # the fewest layers of a stack that mixes layer types
COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "decoder_layers")  # the first one a config declares
ATTENTION = {"full_attention", "sliding_attention", "chunked_attention"}  # of `layer_types`: a plain transformer's

# default configs without the hybrid pattern of the published models (constructor arguments; cut like any pattern)
REPRESENTATIVE = {
    # all Mamba-2 layers by default; Bamba-9B: attention at layers 9, 18 and 27 of 32
    "bamba": {"attn_layer_indices": [9, 18, 27]},
    # all Mamba-2 layers by default; Granite 4.0 H: a few attention layers between Mamba-2 ones (here 1 in 4)
    "granitemoehybrid": {"layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8},
    # all attention by default; LFM2: short-convolution layers with attention every few layers (here 1 in 3)
    "lfm2": {"full_attn_idxs": list(range(2, 32, 3))},
    # no layer_types by default (the model cannot be built); LFM2-MoE: as LFM2
    "lfm2_moe": {"layer_types": ["full_attention" if i % 3 == 2 else "conv" for i in range(32)]},
}


def count_name(config) -> str | None:
    """The config's layer-count attribute."""
    return next((name for name in COUNTS if isinstance(getattr(config, name, None), int)), None)


def per_layer(config, unique: bool = True) -> dict[str, list]:
    """The config's per-layer lists (of any element type): `layer_types` first, then its attributes (with
    `unique`, each value once: an alias such as `layer_types` for `layers_block_type` is listed once)."""
    name = count_name(config)
    n = getattr(config, name) if name else None
    lists: dict[str, list] = {}
    for attr in ["layer_types"] + sorted(a for a in vars(config) if not a.startswith("_")):
        try:
            value = getattr(config, attr, None)
        except Exception:  # noqa: BLE001  (a property that cannot answer)
            continue
        if isinstance(value, (list, tuple)) and n and len(value) == n and \
                not (unique and list(value) in lists.values()):
            lists[attr] = list(value)
    return lists


def indexed(attr: str, value, full: int) -> bool:
    """Whether an attribute holds layer indices: a list of them (`attn_layer_indices`, `full_attn_idxs`,
    `hybrid_layer_ids`, ...) or a dict keyed by them (`per_layer_config`)."""
    if not any(word in attr for word in ("layer", "idx", "indices")) or not isinstance(value, (list, tuple, dict)):
        return False
    return all(str(i).isdigit() and int(i) < full for i in value) and not isinstance(value, str)


def patterns(config) -> dict[str, list[str]]:
    """The per-layer lists of strings: the layer pattern (`layer_types`, `mlp_layer_types`, ...)."""
    return {k: v for k, v in per_layer(config).items() if all(isinstance(x, str) for x in v)}


def kinds(config) -> set[str]:
    """Every layer type the config's pattern gives."""
    return {kind for values in patterns(config).values() for kind in values}


def with_layers(config, n: int, wanted: set[str] = frozenset()):
    """A copy of `config` with `n` layers and a layer pattern for `n`: the class's own (its per-layer lists and
    layer-index attributes left to its defaults), else the class's with the given layer indices kept where < n,
    else the per-layer lists cut to n (indices kept where < n); the first that holds every type of `wanted`, else
    the first the class accepts (None if it accepts none)."""
    name = count_name(config)
    full = getattr(config, name)
    lists = per_layer(config, unique=False)
    data = config.to_dict()
    indices = {k: v for k, v in data.items() if k not in lists and indexed(k, v, full)}
    kept = {k: (type(v)((i, x) for i, x in v.items() if int(i) < n) if isinstance(v, dict) else
                type(v)(i for i in v if i < n)) for k, v in indices.items()}
    derived = {k: v for k, v in data.items() if k not in lists and k not in indices}
    cut = {k: type(v)(v[:n]) for k, v in data.items() if k in lists}
    attempts = [derived, {**derived, **kept}, {**data, **kept, **cut}]
    first = None
    for attempt in attempts:
        try:
            small = type(config).from_dict({**attempt, name: n})
        except Exception:  # noqa: BLE001  (the class rejects this layer count or these lists)
            continue
        if getattr(small, name) != n or any(len(v) != n for v in per_layer(small).values()) or \
                not set(patterns(small)) >= set(patterns(config)):
            continue
        if kinds(small) >= wanted:
            return small
        first = first or small
    return first


def plans(config):
    """The layer counts to build `config` (the full-size default, its decoder's text config) with, best first, each
    with a config of that many layers whose pattern `adopt` copies (None: just set the count): a plain transformer
    gets one (2 layers); a mixed stack the fewest N >= 4 whose pattern holds every layer type, then (for a model that
    cannot be built with it: zamba's block shared between its hybrid layers needs two of them) the fewest that hold
    each twice, three times, ...; else its full count."""
    name = count_name(config)
    if name is None:
        yield PLAIN, None
        return
    full = getattr(config, name)
    wanted = kinds(config)
    plain = set(getattr(config, "layer_types", None) or ()) <= ATTENTION
    if plain and not wanted:
        yield PLAIN, None  # no pattern: the count alone
        return
    times, found = 1, False
    for n in ([PLAIN] if plain else []) + list(range(MIXED, max(full, MIXED) + 1)):
        small = with_layers(config, n, wanted)
        if small is None:
            continue
        counts = [value for values in patterns(small).values() for value in values]
        if all(counts.count(kind) >= times for kind in wanted):
            found, times = True, times + 1
            yield n, small
            if plain:
                return
    if not found:
        yield (PLAIN, None) if plain else (max(full, MIXED), with_layers(config, max(full, MIXED), wanted))


def adopt(config, small) -> None:
    """Copy onto `config` (already shrunk) the layer pattern of `small` (from `plans`): each per-layer list and each
    layer-index attribute that differs."""
    if small is None:
        return
    n = getattr(small, count_name(small))
    lists = per_layer(small, unique=False)
    for attr in small.to_dict():
        value = getattr(small, attr, None)
        if attr.startswith("_") or not (attr in lists or indexed(attr, value, n)):
            continue
        if getattr(config, attr, None) != value:
            try:
                setattr(config, attr, value)
            except (AttributeError, TypeError, ValueError):
                pass


def described(config) -> dict:
    """What the result records: the layer count and the per-layer string lists the model was built with."""
    name = count_name(config)
    record = {"layers": getattr(config, name) if name else None}
    lists = patterns(config)
    if lists:
        record["layer_types"] = lists
    return record
