"""model/state_layers.py: how a packed step's sequences become state runs (`StateStep.build`), and what a
`StateView` keeps of what a module stores."""
from __future__ import annotations

import torch

from hf_paged.kv.state import StateSlots
from hf_paged.model import state_layers
from hf_paged.model.state_layers import StateRun, StateStep, StateView


def seq(start, length, slot, fresh=False, store=True, cuts=()):
    return (start, length, slot, fresh, store, cuts)


def test_decodes_run_together_sorted_by_slot_and_read_in_place_when_a_range():
    slots = StateSlots("cpu", 8)
    step = StateStep.build(slots, [seq(0, 1, 5), seq(1, 1, 3), seq(2, 1, 4)], torch.device("cpu"))
    (run,) = step.runs
    assert run.slots.tolist() == [3, 4, 5] and run.rows.tolist() == [1, 2, 0] and run.span == slice(3, 6)
    step = StateStep.build(slots, [seq(0, 1, 5), seq(1, 1, 2)], torch.device("cpu"))
    assert step.runs[0].span is None  # not a range: gathered and scattered


def test_starting_prompts_group_by_length_within_the_padding_budget(monkeypatch):
    """Longest first; a group takes a prompt while its padding stays within PADDING_WASTE of its real rows."""
    monkeypatch.setattr(state_layers, "PADDING_WASTE", 0.1)
    lengths = [100, 95, 40, 38, 37, 5]
    sequences, start = [], 0
    for slot, n in enumerate(lengths):
        sequences.append(seq(start, n, slot, fresh=True))
        start += n
    step = StateStep.build(StateSlots("cpu", 8), sequences, torch.device("cpu"))
    groups = sorted(sorted(r.stop - r.start for r in run.rows) if isinstance(run.rows, list)
                    else [run.rows.stop - run.rows.start] for run in step.runs)
    assert groups == [[5], [37, 38, 40], [95, 100]]


def test_a_view_keeps_a_stored_state_it_handed_out_without_a_copy():
    slots = StateSlots("cpu", 2)
    slots.write((0, "recurrent", 0), torch.arange(2), torch.ones(2, 3))
    view = StateView(slots, 0, StateRun(torch.tensor([0, 1]), torch.arange(2), False), "test")
    state = view.get_recurrent_state(0)
    state.mul_(2)  # a step that updates the state it was given in place
    assert view.update_recurrent_state(state, 0) is state
    other = torch.zeros(2, 3)
    assert view.update_recurrent_state(other, 0) is not other  # anything else is copied


def test_on_views_runs_the_native_part_only_on_a_state_view():
    """`on_views`: the native function where the last positional argument is a `StateView` and it gives an output;
    transformers' function, as called, for another cache, a cache passed by keyword, or a native None."""
    from hf_paged.model.state_layers import StateView, on_views

    view = StateView.__new__(StateView)
    calls = []

    def native(module, x, cache, prefill):
        calls.append(("native", prefill))
        return None if x == "decline" else "native out"

    def original(module, x, cache, **kwargs):
        calls.append(("original", cache is view, kwargs))
        return "own out"

    scan = on_views(native, prefill=True)(original)
    assert scan("m", "x", view) == "native out" and calls == [("native", True)]
    assert scan("m", "x", object(), flag=1) == "own out" and calls[-1] == ("original", False, {"flag": 1})
    assert scan("m", "decline", view) == "own out" and calls[-2:] == [("native", True), ("original", True, {})]
    calls.clear()
    assert scan("m", "x", cache=view) == "own out" and calls == [("original", True, {})]
