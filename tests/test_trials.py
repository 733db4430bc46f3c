"""Choosing a fast path by timing real calls (hf_paged/trials.py): a trial runs the candidates in turn with a
warm-up each, drops a far slower one early, takes medians; the baseline stays unless beaten by the margin; a table
keeps one choice per key, under its lock, across threads. Times are fed in, never measured."""
import threading

import pytest

from hf_paged import trials
from hf_paged.trials import DROP, SAMPLES, Choice, Table, Trial, fastest

BASELINE = "f_linear"


def trial_of(costs: dict[str, list[float]]) -> tuple[Trial, dict[str, int]]:
    """A Trial of fake candidates and a driver: each call of `name` costs its next listed time (the last repeats)."""
    return Trial({name: name for name in costs}), dict.fromkeys(costs, 0)


def drive(trial: Trial, costs: dict[str, list[float]], calls: dict[str, int], limit: int = 100):
    """Calls as the trial names them until it completes: (each candidate's seconds, the names in call order)."""
    order = []
    for _ in range(limit):
        name = trial.next()
        order.append(name)
        cost = costs[name][min(calls[name], len(costs[name]) - 1)]
        calls[name] += 1
        done = trial.add(name, cost)
        if done is not None:
            return done, order
    raise AssertionError("the trial never ended")


def test_every_block_of_a_trial_runs_each_candidate_once_in_a_rotating_order():
    trial, _ = trial_of({"a": [1.0], "b": [1.0], "c": [1.0]})
    order = [trial.next() for _ in range(9)]
    assert [sorted(order[i:i + 3]) for i in (0, 3, 6)] == [["a", "b", "c"]] * 3
    assert order[:3] != order[3:6]  # rotates: layers of one shape called alternately meet every candidate
    trial, _ = trial_of({"a": [1.0], "b": [1.0]})
    order = [trial.next() for _ in range(8)]
    assert order[0::2] != ["a"] * 4 and sorted(order[0::2]) == ["a", "a", "b", "b"]


def test_a_trial_takes_each_candidates_median_after_a_warm_up(monkeypatch):
    monkeypatch.setattr(trials, "LONG_S", float("inf"))  # the costs here are seconds: no long-call rule
    costs = {"slow": [9.0, 3.0, 5.0, 7.0, 4.0, 6.0, 3.5], "fast": [9.0, 5.0, 6.0, 2.0, 1.0, 1.5, 2.5]}
    trial, calls = trial_of(costs)
    seconds, order = drive(trial, costs, calls)
    assert calls == {"slow": 1 + SAMPLES, "fast": 1 + SAMPLES}  # the warm-up call (9.0) not counted
    assert seconds == {"slow": 5.0, "fast": 2.0}  # medians of the counted calls
    assert trial.spent == sum(sum(c[:1 + SAMPLES]) for c in costs.values())
    assert fastest(seconds, BASELINE) == "fast"


def test_a_trial_drops_a_candidate_far_behind_twice(monkeypatch):
    monkeypatch.setattr(trials, "LONG_S", float("inf"))  # the costs here are seconds: no long-call rule
    # warm-up, first counted call: w_xt 2.5x behind twice (out); f_linear behind once only (stays)
    costs = {"kernel": [1.0, 1.0, 0.75], "w_xt": [2.5, 2.75, 0.125], "f_linear": [4.0, 1.25, 2.0]}
    trial, calls = trial_of(costs)
    seconds, _ = drive(trial, costs, calls)
    assert calls == {"kernel": 1 + SAMPLES, "w_xt": 2, "f_linear": 1 + SAMPLES}
    assert seconds == {"kernel": 0.75, "w_xt": 2.5, "f_linear": 2.0}  # w_xt: its better call
    assert trial.names == ["kernel", "f_linear"]
    times = {name: list(t) for name, t in trial.times.items()}
    assert trial.add("w_xt", 1e-9) is None and trial.times == times  # a call of it still running elsewhere: ignored


def test_a_trial_drops_a_candidate_closer_behind_on_long_calls():
    """Calls of LONG_S and more (an LM head): 1.3x behind twice is out; on short calls it stays."""
    long = {"kernel": [0.02], "w_xt": [0.026], "f_linear": [0.03, 0.022, 0.02]}
    trial, calls = trial_of(long)
    drive(trial, long, calls)
    assert calls == {"kernel": 1 + SAMPLES, "w_xt": 2, "f_linear": 1 + SAMPLES}
    short = {name: [t / 100 for t in times] for name, times in long.items()}
    trial, calls = trial_of(short)
    drive(trial, short, calls)
    assert calls == dict.fromkeys(long, 1 + SAMPLES)
    assert DROP > 1.3


def test_a_fast_path_must_beat_f_linear_by_the_margin_and_ties_go_to_the_first():
    assert fastest({"kernel": 2.0, "w_xt": 2.0, "f_linear": 3.0}, BASELINE) == "kernel"
    assert fastest({"kernel": 2.0, "w_xt": 1.0, "f_linear": 3.0}, BASELINE) == "w_xt"
    assert fastest({"kernel": 0.96, "w_xt": 0.99, "f_linear": 1.0}, BASELINE) == "f_linear"  # within 5 %
    assert fastest({"kernel": 0.94, "w_xt": 0.99, "f_linear": 1.0}, BASELINE) == "kernel"
    assert fastest({"kernel": 1.1, "w_xt": 1.2, "f_linear": 1.0}, BASELINE) == "f_linear"
    assert fastest({"kernel": 1.0, "w_xt": 0.99}, BASELINE) == "w_xt"  # no baseline: the least time


class Kept(Table):
    """A table that keeps what each choice runs, as the few-row linears' table does."""

    def __init__(self):
        super().__init__("torch")
        self.kept = {}

    def decided(self, key, choice, products):
        self.kept[key] = products[choice.path]


def run_trial(table: Table, key, costs: dict[str, float], baseline: str | None = None) -> Choice:
    products = {name: f"run {name}" for name in costs}
    for _ in range(100):
        name = table.next_call(key, products)
        if name is None:
            return table.choices[key]
        choice = table.record(key, name, costs[name], baseline)
        if choice is not None:
            assert table.next_call(key, products) is None and key not in table.trials
            return choice
    raise AssertionError("the trial never ended")


@pytest.mark.parametrize("costs, baseline, winner", [
    ({"torch": 10.0, "keys": 1.0, "vector": 0.8}, None, "vector"),
    ({"torch": 1.0, "keys": 0.97}, None, "torch"),  # within the margin: the table's baseline stays
    ({"torch": 1.0, "keys": 0.97}, "keys", "keys"),  # a baseline given for the call
])
def test_a_table_keeps_the_trials_choice_and_what_it_runs(costs, baseline, winner):
    table = Kept()
    choice = run_trial(table, "k", costs, baseline)
    assert choice.path == winner and table.choices == {"k": choice} and table.kept == {"k": f"run {winner}"}
    assert choice.source == "measured" and set(choice.seconds) == set(costs) and choice.probe_seconds > 0
    assert table.record("k", "torch", 1e-9) is None and table.choices["k"] is choice  # late calls change nothing


def test_a_settled_choice_is_kept_and_the_first_one_wins():
    table = Kept()
    assert table.next_call("k", {"a": 1, "b": 2}) == "a" and "k" in table.trials
    first = table.settle("k", Choice("b", {}, "forced"), {"a": 1, "b": 2})
    assert first.path == "b" and not table.trials and table.kept == {"k": 2}
    assert table.settle("k", Choice("a", {}, "forced")) is first and table.next_call("k", {"a": 1}) is None
    table.clear()
    assert not table.choices and not table.trials and table.next_call("k", {"a": 1, "b": 2}) == "a"


def test_only_trial_calls_are_counted_as_recorded():
    table, before = Table(BASELINE), trials.recorded.calls
    table.record("k", "a", 1.0)  # no trial open
    assert trials.recorded.calls == before
    name = table.next_call("k", {"a": 1, "b": 2})
    table.record("k", name, 1.0)
    assert trials.recorded.calls == before + 1
    table.settle("k", Choice("a", {}, "forced"))
    table.record("k", "a", 1.0)  # chosen meanwhile
    assert trials.recorded.calls == before + 1


def test_timed_runs_untimed_without_a_name_and_times_a_trial_call(monkeypatch):
    now = [0.0]

    def run(cost):
        now[0] += cost
        return cost

    monkeypatch.setattr(trials, "clock", lambda: now[0])
    table, made = Table("a"), None
    name = table.next_call("k", {"a": 1, "b": 2})
    assert table.timed("k", None, lambda: run(5.0)) == (5.0, None) and table.trials["k"].spent == 0  # not a trial's
    for _ in range(4 * (1 + SAMPLES)):
        name = name or table.next_call("k", {"a": 1, "b": 2})
        if name is None:
            break
        _, made = table.timed("k", name, lambda: run({"a": 3.0, "b": 1.0}[name]))
        name = None
    assert made is not None and made.path == "b" and made.seconds == {"a": 3.0, "b": 1.0}


def test_threads_sharing_a_table_make_one_choice():
    table, barrier, made = Table("a"), threading.Barrier(4), []

    def caller():
        barrier.wait(timeout=10)
        for _ in range(200):
            name = table.next_call("k", {"a": 1, "b": 2})
            if name is None:
                return
            choice = table.record("k", name, {"a": 2.0, "b": 1.0}[name])
            if choice is not None:
                made.append(choice)

    threads = [threading.Thread(target=caller) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(made) == 1 and table.choices == {"k": made[0]} and made[0].path == "b" and not table.trials


def run_layers(table: Table, costs: dict[str, float], modules: int, copying: frozenset, steps: int = 100,
               first: int = 0):
    """Steps that call one key from `modules` modules (ids `first`, `first` + 1, ...) in turn (layers of one shape),
    each call of a candidate costing costs[name]: (the choice, the step it came in, {module: candidates it ran},
    SKIPs)."""
    ran, skips = {}, 0
    for step in range(steps):
        for module in range(first, first + modules):
            name = table.next_call_for("key", costs, module, copying)
            if name is None:
                return table.choices["key"], step, ran, skips
            if name == trials.SKIP:
                skips += 1
                continue
            ran.setdefault(module, set()).add(name)
            table.record("key", name, costs[name])
    raise AssertionError("the trial never ended")


@pytest.mark.parametrize("copy_cost, winner", [(0.5e-3, "copy"), (3e-3, "kernel"), (0.9e-3, "kernel")])
def test_copying_candidates_run_on_a_few_modules_of_a_key_only(copy_cost, winner):
    """24 layers of one shape: the candidate that copies the weights runs on some of the first COPY_HOLDERS of them
    (the rest never make a copy), the trial still ends within a few steps, and picks as a plain trial would."""
    costs = {BASELINE: 1e-3, "kernel": 0.8e-3, "copy": copy_cost}
    choice, step, ran, skips = run_layers(Table(BASELINE), costs, 24, frozenset({"copy"}))
    holders = {module for module, names in ran.items() if "copy" in names}
    assert holders and holders <= set(range(trials.COPY_HOLDERS))
    assert all(names <= {BASELINE, "kernel"} for module, names in ran.items() if module not in holders)
    assert choice.path == winner and set(choice.seconds) == set(costs)
    assert step <= 3 and skips == 0


def test_a_key_of_few_modules_runs_every_candidate_on_each_as_a_plain_trial_does():
    costs = {BASELINE: 1e-3, "kernel": 0.9e-3, "copy": 0.95e-3}
    choice, step, ran, _ = run_layers(Table(BASELINE), costs, 2, frozenset({"copy"}))
    assert choice.path == "kernel" and all(names == set(costs) for names in ran.values())
    _, plain_step, _, _ = run_layers(Table(BASELINE), costs, 2, frozenset())  # nothing copies: next_call's rotation
    assert step <= plain_step + 1


def test_modules_beyond_the_holders_skip_where_only_copying_candidates_are_left():
    table = Table(BASELINE)
    costs = {BASELINE: 10e-3, "copy": 1e-3}  # the baseline is dropped after its first counted call (DROP)
    names = []
    for _ in range(6):
        for module in range(8):
            name = table.next_call_for("key", costs, module, frozenset({"copy"}))
            names.append((module, name))
            if name not in (None, trials.SKIP):
                table.record("key", name, costs[name])
    assert table.choices["key"].path == "copy"
    assert any(name == trials.SKIP for module, name in names if module >= trials.COPY_HOLDERS)
    assert all(name != "copy" for module, name in names if module >= trials.COPY_HOLDERS)


def test_holders_that_stop_calling_give_their_places_up():
    """Another model of the same shapes (the first one no longer run): its modules take the places, and the trial
    ends; without that the copying candidate would never run again and the trial would stay open for good."""
    table = Table(BASELINE)
    costs = {BASELINE: 1e-3, "copy": 0.5e-3}
    copying = frozenset({"copy"})
    for module in range(trials.COPY_HOLDERS):  # the first model: one call each, then never again
        table.next_call_for("key", costs, module, copying)
    choice, step, ran, _ = run_layers(table, costs, 8, copying, first=100)  # the second model's 8 modules
    assert choice.path == "copy" and step < 20
    assert len({module for module, names in ran.items() if "copy" in names}) <= trials.COPY_HOLDERS


@pytest.mark.parametrize("modules", [8, 24])
def test_holders_still_calling_keep_their_places_while_other_modules_pass_over_copying_candidates(modules):
    """Modules beyond the holders pass over the copying candidates in turn (several of the rotation's names for one
    call); that is not calls of other modules: a holder that calls in every step keeps its place, so no more than
    COPY_HOLDERS modules ever make a copy (CI once saw a fifth layer copy its weights)."""
    costs = {BASELINE: 1e-3, "kernel": 0.9e-3, "copy_a": 0.8e-3, "copy_b": 0.85e-3, "copy_c": 0.95e-3}
    copying = frozenset({"copy_a", "copy_b", "copy_c"})
    choice, _, ran, _ = run_layers(Table(BASELINE), costs, modules, copying)
    assert len({module for module, names in ran.items() if names & copying}) <= trials.COPY_HOLDERS
    assert choice.path == "copy_a"
