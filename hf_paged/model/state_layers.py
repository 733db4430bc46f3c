"""State layers (Gated DeltaNet, Mamba / Mamba-2, short convolutions, ...) on the engine's packed steps.

transformers' state modules read and write their per-sequence state through the cache's linear-attention calls
(`get_conv_state`, `update_conv_state`, `get_recurrent_state`, `update_recurrent_state`, `has_previous_state`) and
mix tokens along the time axis, so a packed step (every sequence's rows side by side in one row of the batch) cannot
go through them as it is. During a paged forward each state module's forward (`state_forward`) runs the module's own
forward once per group of sequences instead: every single-token sequence that has a state in one batched call
[B, 1, hidden], every other sequence alone [1, L, hidden]; each call gets a `StateView`, a cache that answers those
calls from the sequences' slots in `kv.StateSlots` and writes what the module stored back into them. The module's own
code computes everything, so the result is what it computes for each sequence alone.

A continuation (a piece after a state: a chunk of a prompt, the rest after a prefix hit, a recompute) must give
what the whole input at once gives. Some modules' own code continues a state only one token at a time (transformers'
Mamba-1 scan starts a multi-token input from a zero state): such a module runs its continuations in the mode
`state_continuation.continuation_modes` chose for it (`AS_IS`, `KEEP_STATES`, `TOKEN_BY_TOKEN`).

Which module holds each state layer is found by `state_modules.find_state_modules`, from one forward on
transformers' cache (or the model's own cache class: minimax keeps each lightning-attention layer's recurrent state
through `get_linear_cache` / `set_linear_cache`, which `StateView` answers as well).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from ..kv.state import StateSlots
from .own_state import bridge
from .state_rows import by_row, join, left_padding_mask, rows_of

STATE_CALLS = ("get_conv_state", "update_conv_state", "get_recurrent_state", "update_recurrent_state",
               "has_previous_state", "get_linear_cache", "set_linear_cache")  # the last two: minimax's own cache

# How a state module runs a continuation of more than one token (one mode per module, see the module doc):
AS_IS = "as_is"  # in one call: its own forward continues the state it is given
KEEP_STATES = "keep_states"  # asked to keep every token's recurrent state (its recurrent form), KEEP_SPAN at a time
TOKEN_BY_TOKEN = "token_by_token"  # one call per token (the single-token path every decode takes)
KEEP_SPAN = 128  # tokens per call in KEEP_STATES mode: the module holds a copy of its state per token of a call


class UnsupportedState(ValueError):
    """A state module asks the cache for something the state slots do not implement."""


@dataclass(slots=True)
class StateRun:
    """One call of a state module in a step: the packed rows it takes, the slots of its sequences ([B] long on the
    device), whether they start from no state (`fresh`, their first token is in these rows), whether what the
    module stores is kept (`store`; not for a query-only row reading a prompt's state) and the checkpoint slot that
    gets a copy of it (`checkpoint`: the state after these rows, kept for prefix hits)."""

    # a slice: one sequence [1, L]; a tensor: B single-token sequences [B, 1]; a list of slices: B sequences that
    # start here, left-padded to the longest into [B, L] with an attention mask (as HF's own padded batch runs them)
    rows: slice | torch.Tensor | list
    slots: torch.Tensor
    fresh: bool
    store: bool = True
    checkpoint: torch.Tensor | None = None  # per sequence: checkpoint slot, or -1 for none
    span: slice | None = None  # single tokens whose slots are a range (`slots` is arange(span)): read in place

    def pieces(self) -> list["StateRun"]:
        """A left-padded run as one run per sequence (for a module that takes no attention mask)."""
        return [StateRun(rows, self.slots[i:i + 1], True, self.store,
                         None if self.checkpoint is None or int(self.checkpoint[i]) < 0 else self.checkpoint[i:i + 1])
                for i, rows in enumerate(self.rows)]


@dataclass(slots=True)
class StateStep:
    """The state side of one packed forward: the slots, the checkpoint store and the runs in the order they must go
    (a sequence's pieces in order, a query-only row after the sequence whose state it reads)."""

    slots: StateSlots
    runs: list[StateRun]
    checkpoints: StateSlots | None = None

    @classmethod
    def build(cls, slots: StateSlots, sequences: list[tuple], device: torch.device,
              checkpoints: StateSlots | None = None) -> "StateStep":
        """`sequences`: (first packed row, number of rows, slot, fresh, store, checkpoints) in packed order, where
        `checkpoints` lists (rows into the sequence, checkpoint slot): its run is cut there, and the state after the
        cut is copied to the checkpoint. Single-token sequences with a state run in one batched call, the first
        pieces of sequences that start in this step in one left-padded call, every other piece alone."""
        decodes, starts, pieces = [], [], []
        for start, length, slot, fresh, store, cuts in sequences:
            if length == 1 and not fresh and store and not cuts:  # (a prompt's last token may end a checkpoint)
                decodes.append((start, slot))
                continue
            bounds = [0] + [offset for offset, _ in cuts] + ([length] if not cuts or cuts[-1][0] < length else [])
            marks = [checkpoint for _, checkpoint in cuts] + [-1]
            for i, (first, last) in enumerate(zip(bounds, bounds[1:])):
                piece = (slice(start + first, start + last), slot, fresh and i == 0, store, marks[i])
                (starts if piece[2] and store else pieces).append(piece)
        runs = []
        if decodes:
            rows, ids = zip(*sorted(decodes, key=lambda decode: decode[1]))  # by slot: often a range
            span = slice(ids[0], ids[-1] + 1) if ids[-1] - ids[0] == len(ids) - 1 else None
            runs.append(StateRun(torch.tensor(rows, device=device), torch.tensor(ids, device=device), False,
                                 span=span))
        for group in _similar_lengths(starts):
            if len(group) == 1:
                pieces.insert(0, group[0])
                continue
            rows, ids, _, _, marks = zip(*group)
            runs.append(StateRun(list(rows), torch.tensor(ids, device=device), True, True,
                                 torch.tensor(marks, device=device) if max(marks) >= 0 else None))
        for rows, slot, fresh, store, mark in pieces:
            runs.append(StateRun(rows, torch.tensor([slot], device=device), fresh, store,
                                 torch.tensor([mark], device=device) if mark >= 0 else None))
        runs.sort(key=lambda run: not run.store)  # readers of a state after every writer of this step
        return cls(slots, runs, checkpoints)


# a left-padded batch of starting sequences computes at most this share of padding rows (64 prompts of 16-200 tokens
# on the Qwen3.5-shaped benchmark model, 2-core EPYC: prefill 4.78 s at 0.25, 5 groups; 4.42 s at 0.1, 10 groups)
PADDING_WASTE = 0.1


def _similar_lengths(starts: list) -> list[list]:
    """Sequences starting in a step, longest first, in groups whose padding to the group's longest stays within
    PADDING_WASTE of their real rows (fewer calls of the state modules, little padding computed)."""
    groups: list[list] = []
    for piece in sorted(starts, key=lambda p: p[0].stop - p[0].start, reverse=True):
        group = groups[-1] if groups else None
        if group is not None:
            width = group[0][0].stop - group[0][0].start
            real = sum(p[0].stop - p[0].start for p in group) + piece[0].stop - piece[0].start
            if width * (len(group) + 1) <= (1 + PADDING_WASTE) * real:
                group.append(piece)
                continue
        groups.append([piece])
    return groups


class StateView:
    """transformers' linear-attention cache calls for one layer and the sequences of one `StateRun`, answered from
    their slots. What the module stores is kept here (a later call on the same view continues from it) and written to
    the slots by `write_back`. Anything else a module asks of it raises `UnsupportedState` (a module that needs more
    is refused by the start-up check)."""

    def __init__(self, slots: StateSlots, layer: int, run: StateRun, model_type: str, continuation: str = AS_IS):
        self.slots, self.layer, self.run, self.model_type = slots, layer, run, model_type
        self.continuation = continuation
        self.keep = 0  # the answer of `get_recurrent_states_to_keep` (`run_module` sets it per call)
        self.values: dict[tuple[str, int], torch.Tensor] = {}
        self.started: set[int] = set()  # state indices whose conv state this call stored (a fresh run has one then)

    def _check(self, layer_idx: int) -> None:
        if layer_idx != self.layer:
            raise UnsupportedState(f"model type {self.model_type!r}: the state module of layer {self.layer} asked "
                                   f"for the state of layer {layer_idx}")

    def _known(self, kind: str, index: int) -> torch.Tensor | None:
        if (kind, index) not in self.values:
            value = None if self.run.fresh else self.slots.read((self.layer, kind, index), self.run.slots,
                                                                self.run.span)
            if value is None:
                return None
            self.values[(kind, index)] = value
        return self.values[(kind, index)]

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        if layer_idx is not None:
            self._check(layer_idx)
        if not self.run.fresh:
            return True
        return (0 if state_idx is None else state_idx) in self.started

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        self._check(layer_idx)
        return self._known("conv", state_idx) if self.has_previous_state(None, state_idx) else None

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        """As transformers' `LinearAttentionLayer.update_conv_state`: the new inputs after the previous window (or
        left-padded with zeros to the kernel at a sequence's start); keeps the last kernel-size columns."""
        self._check(layer_idx)
        previous = self.get_conv_state(layer_idx, state_idx)
        if previous is None:
            kernel = conv_kernel_size if conv_kernel_size is not None else conv_states.shape[-1]
            full = conv_states
            if full.shape[-1] < kernel:
                full = torch.nn.functional.pad(full, (kernel - full.shape[-1], 0), value=0)
            stored = conv_states.new_zeros((*conv_states.shape[:-1], kernel))
        else:
            kernel = previous.shape[-1]
            full = torch.cat([previous, conv_states], dim=-1)
            stored = previous
        stored.copy_(full[..., -kernel:])
        self.values[("conv", state_idx)] = stored
        self.started.add(state_idx)
        return full

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        self._check(layer_idx)
        return self._known("recurrent", state_idx) if self.has_previous_state(None, state_idx) else None

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs) -> torch.Tensor:
        self._check(layer_idx)
        last = recurrent_states if isinstance(recurrent_states, torch.Tensor) else recurrent_states[-1]
        if last is not self.values.get(("recurrent", state_idx)):  # (gated_delta's decode step updates the view's own)
            self.values[("recurrent", state_idx)] = last.clone()
        return self.values[("recurrent", state_idx)]

    def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
        """As minimax's own cache: the layer's recurrent state (its K^T V), None while the sequence has none (its
        module then starts from zeros, block by block; with a state it continues token by token)."""
        self._check(layer_idx)
        if self.run.fresh and ("recurrent", 0) not in self.values:
            return None
        return self._known("recurrent", 0)

    def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
        """As minimax's own cache: the layer's recurrent state after these rows (kept as `update_recurrent_state`
        keeps it)."""
        self._check(layer_idx)
        self.values[("recurrent", 0)] = linear_cache.clone()

    def is_recording_past(self, layer_idx: int | None = None) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """0 (only the last state is kept), or in `KEEP_STATES` mode in a continuation's call every token's: a module
        asked for them runs its recurrent form, from the previous state (only the last one is stored)."""
        return self.keep

    def increase_count(self, layer_idx: int | None = None, state_idx: int = 0) -> None:
        """transformers counts tokens here; the engine knows each sequence's length."""

    def __getattr__(self, name: str):
        raise UnsupportedState(f"model type {self.model_type!r}: its state module (layer {self.layer}) calls "
                               f"cache.{name}, which hf_paged's state slots do not implement")

    def write_back(self, checkpoints: StateSlots | None = None) -> None:
        if self.run.store:
            for (kind, index), value in self.values.items():
                self.slots.write((self.layer, kind, index), self.run.slots, value, self.run.span)
                marks = self.run.checkpoint
                if marks is not None:
                    kept = (marks >= 0).nonzero().reshape(-1)
                    checkpoints.write((self.layer, kind, index), marks[kept], value.index_select(0, kept))


def on_views(native, prefill: bool):
    """A substitute factory for a transformers scan function `f(module, *inputs, cache, **kwargs)` (cache the last
    positional argument): `native(module, *inputs, cache, prefill=prefill)` where the cache is a `StateView` and it
    returns an output, else the function it replaces (`original`), as called (also for a cache passed by keyword).
    Native code behind raw pointers: never traced by dynamo (a compiled model)."""
    def factory(original):
        @torch.compiler.disable
        def scan(module, *args, **kwargs):
            if args and isinstance(args[-1], StateView):
                out = native(module, *args, prefill=prefill)
                if out is not None:
                    return out
            return original(module, *args, **kwargs)
        return scan
    return factory


def state_forward(layer: int, cache_keyword: str, continuation: str = AS_IS, fast=None):
    """A `ModulePatches` adapter factory: the module's forward on a packed step, one call per `StateRun` (a
    continuation as `continuation` says), through `fast` where given (a faster forward of the module that
    `state_fast.fast_paths` chose) or the module's own. Arguments besides the hidden states and the cache must be
    None (the engine's forward builds no masks); the output (a tensor or a tuple of tensors, rows along dimension 1) is
    put back together in packed order."""
    def factory(module, owner):
        own = own_forward(module)
        signature = inspect.signature(own)
        takes_mask = "attention_mask" in signature.parameters
        model_type = getattr(getattr(module, "config", None), "model_type", type(module).__name__)

        def forward(*args, **kwargs):
            step = getattr(owner.require_context(module), "states", None)
            if step is None:
                raise UnsupportedState(f"model type {model_type!r}: a state layer ran without state slots")
            hidden_states, per_row = split_arguments(signature, cache_keyword, args, kwargs, f"model type "
                                                     f"{model_type!r}: its state module (layer {layer})")
            outputs = []
            for run in _runs(step.runs, takes_mask):
                view = StateView(step.slots, layer, run, model_type, continuation)
                outputs += run_module(fast or own, cache_keyword, hidden_states, per_row, view, step.checkpoints)
            return packed(outputs, hidden_states.shape[1], model_type)

        return forward
    return factory


def own_forward(module):
    """What a state module's runs call: for a module keeping its state on itself or in a passed argument its bridge to
    the cache calls (`own_state.bridge`), else its own forward (an instance forward it carries, else its class's)."""
    return bridge(module) or vars(module).get("forward") or type(module).forward.__get__(module)


# keywords a state module may get that change nothing here (the engine's own, passed down every module; flags)
IGNORED = frozenset({"attention_mask", "position_ids", "cache_position", "use_cache", "output_attentions",
                     "paged_context", "hf_paged_kv_shapes"})
PASSED_IF_NAMED = frozenset({"position_ids"})  # passed on (by row) to a function naming it (own_state's bridges)


def split_arguments(signature: inspect.Signature, cache_keyword: str, args: tuple, kwargs: dict, who: str) -> tuple:
    """(hidden states [1, T, ...], {keyword: value with one entry per packed row}) of a state module's call; the cache
    and the `IGNORED` keywords are dropped. Raises UnsupportedState for any other argument that is set, or a batch."""
    bound = signature.bind(*args, **kwargs).arguments
    hidden_states = bound.pop(next(iter(signature.parameters)))
    bound.pop(cache_keyword, None)
    extra = {**bound.pop("kwargs", {}), **bound}
    num_rows = hidden_states.shape[1]
    ignored = IGNORED - (PASSED_IF_NAMED & set(signature.parameters))
    per_row = {k: v for k, v in extra.items() if k not in ignored and by_row(v, num_rows)}
    odd = sorted(k for k, v in extra.items() if v is not None and v is not False and k not in ignored
                 and k not in per_row)
    if odd or hidden_states.shape[0] != 1:
        raise UnsupportedState(f"{who} got {odd or 'a batch'}, which hf_paged's packed steps do not pass on")
    mask = signature.parameters.get("attention_mask")
    if mask is not None and mask.default is inspect.Parameter.empty:  # required (minimax): None but for padded starts
        per_row["attention_mask"] = None
    return hidden_states, per_row


def run_module(own, cache_keyword: str, hidden_states: torch.Tensor, per_row: dict, view: StateView,
               checkpoints: StateSlots | None = None) -> list[tuple]:
    """The module's own forward (`own`) on the rows of `view.run` of the packed `hidden_states` and `per_row` values,
    with `view` as its cache; what it stored is then written back. [(rows, output)] in row order: one call, or for a
    continuation (a run that is not fresh) in `KEEP_STATES` mode calls of at most KEEP_SPAN tokens that ask for every
    token's state, in `TOKEN_BY_TOKEN` mode one call per token; the calls share the view, so each continues the state
    the one before stored."""
    run = view.run
    parts = [run.rows]
    span = {KEEP_STATES: KEEP_SPAN, TOKEN_BY_TOKEN: 1}.get(view.continuation)
    if span is not None and not run.fresh and isinstance(run.rows, slice):
        parts = [slice(i, min(i + span, run.rows.stop)) for i in range(run.rows.start, run.rows.stop, span)]
    outputs = []
    for rows in parts:
        if view.continuation == KEEP_STATES and not run.fresh:
            view.keep = rows.stop - rows.start if isinstance(rows, slice) else 1
        inputs = {k: None if v is None else rows_of(v, rows) for k, v in per_row.items()}
        if isinstance(rows, list):
            inputs["attention_mask"] = left_padding_mask(rows, hidden_states.device)
        outputs.append((rows, own(rows_of(hidden_states, rows), **inputs, **{cache_keyword: view})))
    view.write_back(checkpoints)
    return outputs


def _runs(runs: list[StateRun], takes_mask: bool):
    for run in runs:
        if isinstance(run.rows, list) and not takes_mask:
            yield from run.pieces()
        else:
            yield run


def packed(outputs: list, num_rows: int, model_type: str):
    """The runs' outputs (each a tensor or a tuple of tensors / None, rows along dimension 1) as one packed output.
    A tuple's later entry that is not one entry per row in every run (minimax returns its recurrent state [B, heads,
    d, d] second) is None."""
    first = outputs[0][1]
    if isinstance(first, torch.Tensor):
        return join([(rows, out) for rows, out in outputs], num_rows)
    if isinstance(first, tuple):
        return tuple(None if first[i] is None or (i and not all(_per_row(out[i], out[0]) for _, out in outputs))
                     else join([(rows, out[i]) for rows, out in outputs], num_rows) for i in range(len(first)))
    raise UnsupportedState(f"model type {model_type!r}: its state module returns {type(first).__name__}")


def _per_row(value, output: torch.Tensor) -> bool:
    """Whether `value` has the batch and row dimensions of the run's `output` (its first entry)."""
    return (isinstance(value, torch.Tensor) and isinstance(output, torch.Tensor) and value.dim() >= 2
            and value.shape[:2] == output.shape[:2])


def cache_keyword(function) -> str:
    """The name under which `function` takes its cache (transformers 5.x: `cache`, earlier `cache_params` /
    `past_key_values`; an own_state bridge names it in its `cache_keyword`)."""
    params = inspect.signature(function).parameters
    for name in (getattr(function, "cache_keyword", None), "cache", "cache_params", "past_key_values"):
        if name in params:
            return name
    raise UnsupportedState(f"{getattr(function, '__qualname__', function)} takes no cache argument")
