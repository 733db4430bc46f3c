"""model/step_choice.py: whether a few-row CPU step runs the fast paths at all, measured per model and row bucket.
No speed is measured here: each trial step's time is replaced by a fixed cost per candidate."""
import pytest
import torch

from hf_paged import LLM, SamplingParams, trials
from hf_paged.model import FusedLayers, SmallBatchLinears, step_choice
from hf_paged.model.step_choice import FAST, PLAIN, SWITCH, TABLE, StepChoice, mode, step_choices
from hf_paged.tiny import tiny_model

from conftest import greedy_alone

PROMPTS = [[5, 9, 14, 3, 22, 7], [8, 1, 30, 2], [11, 4, 19, 6, 13], [3, 3, 17, 26, 2, 9, 10]]


@pytest.fixture
def measured(monkeypatch, one_torch_thread):
    """Auto mode (the suite runs FAST), an empty table, and the steps actually run: (rows, fast) per step."""
    monkeypatch.setenv(SWITCH, "auto")
    TABLE.clear()
    step_choice.SETTLED.clear()
    runs = []
    original = StepChoice.next

    def spy(self, rows):
        fast, trial = original(self, rows)
        runs.append((rows, fast, None if trial is None else trial[1]))
        return fast, trial
    monkeypatch.setattr(StepChoice, "next", spy)
    yield runs
    TABLE.clear()
    step_choice.SETTLED.clear()


def fake_costs(monkeypatch, costs: dict):
    """Each trial step takes costs[its candidate] seconds."""
    original = StepChoice.record

    def record(trial, seconds):
        original(trial, costs.get(trial[1], seconds) if trial is not None else seconds)
    monkeypatch.setattr(StepChoice, "record", staticmethod(record))


def run(model, max_tokens=24):
    llm = LLM(model, max_num_seqs=8)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outputs]


def test_modes(monkeypatch):
    for value, want in (("", "auto"), ("auto", "auto"), ("fast", FAST), ("1", FAST), ("plain", PLAIN), ("0", PLAIN),
                        ("other", "auto")):
        monkeypatch.setenv(SWITCH, value)
        assert mode() == want
    monkeypatch.delenv(SWITCH)
    assert mode() == "auto"


@pytest.mark.parametrize("plain", [1e-3, 3e-3, 1.91e-3])
def test_a_trial_alternates_then_keeps_the_faster(monkeypatch, measured, plain):
    """Plain must beat the fast paths by the margin (1.91 ms against 2 ms does not)."""
    plain_wins = plain == 1e-3
    model = tiny_model("llama")
    fake_costs(monkeypatch, {FAST: 2e-3, PLAIN: plain})
    active = []
    original = SmallBatchLinears.active
    monkeypatch.setattr(SmallBatchLinears, "active", lambda self, *a: active.append(1) or original(self, *a))
    want = greedy_alone(model, PROMPTS, 40)
    for _ in range(8):  # the products' own trials first: steps that ran one are not counted
        assert run(model, 40) == want
        if step_choices():
            break
    (choice,) = step_choices()
    assert choice["rows"] == 4 and choice["path"] == (PLAIN if plain_wins else FAST)
    assert choice["ms"] == {FAST: 2.0, PLAIN: plain * 1e3}
    decodes = [(fast, name) for rows, fast, name in measured if rows == 4]
    first = decodes.index((True, FAST))
    assert all(fast and name is None for fast, name in decodes[:first])  # fast until one step ran no other trial
    tried = decodes[first:first + 2 * (1 + trials.SAMPLES)]
    assert [name for _, name in tried] == [FAST, PLAIN, PLAIN, FAST] * 3  # in turn, a warm-up and SAMPLES each
    assert all(fast == (name == FAST) for fast, name in tried)
    after = decodes[first + len(tried):]
    assert after and all(fast is not plain_wins and name is None for fast, name in after)  # then only the choice
    assert len(active) == sum(fast for _, fast, _ in measured)  # plain steps swap no forward in


def test_a_choice_holds_for_the_next_engine_of_the_model(monkeypatch, measured):
    model = tiny_model("llama")
    fake_costs(monkeypatch, {FAST: 2e-3, PLAIN: 1e-3})
    while not step_choices():
        run(model, 40)
    measured.clear()
    run(model)
    assert not any(name for rows, _, name in measured if rows == 4)
    assert all(not fast for rows, fast, _ in measured if rows == 4)


def test_steps_that_ran_another_trial_are_not_counted(monkeypatch, measured):
    choice = StepChoice(tiny_model("llama"), torch.device("cpu"))
    for settles in (False, True):  # FAST, no trial, until a step ran no other trial
        fast, trial = choice.next(4)
        assert fast and trial[1] is None and not TABLE.trials
        trials.recorded.calls += 0 if settles else 1  # another table recorded a call during this step
        StepChoice.record(trial, 1.0)
        assert (trial[0] in step_choice.SETTLED) is settles
    for counts in (False, True):
        fast, trial = choice.next(4)
        assert trial[1] == (FAST if fast else PLAIN)
        trials.recorded.calls += 0 if counts else 1
        StepChoice.record(trial, 1.0)
        assert len(TABLE.trials[trial[0]].warm) == counts


def test_many_rows_other_devices_and_forced_modes_take_no_trial(monkeypatch, measured):
    model = tiny_model("llama")
    choice = StepChoice(model, torch.device("cpu"))
    assert choice.next(129) == (True, None) and choice.next(None) == (True, None)
    assert StepChoice(model, torch.device("meta")).next(4) == (True, None)
    monkeypatch.setenv(SWITCH, "plain")
    assert choice.next(4) == (False, None) and choice.next(4096) == (False, None)
    monkeypatch.setenv(SWITCH, "fast")
    assert choice.next(4) == (True, None)
    assert not TABLE.trials


@pytest.mark.parametrize("forced", [FAST, PLAIN])
def test_forced_modes_give_hfs_tokens(monkeypatch, one_torch_thread, forced):
    """Plain steps enter none of the paths and ask the LM head for no picks; fast ones do (the picks forced)."""
    monkeypatch.setenv(SWITCH, forced)
    monkeypatch.setenv("HF_PAGED_GREEDY_HEAD", "force")
    model = tiny_model("llama")
    layers = []
    original = FusedLayers.active
    monkeypatch.setattr(FusedLayers, "active", lambda self: layers.append(1) or original(self))
    llm = LLM(model, max_num_seqs=8)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == greedy_alone(model, PROMPTS, 24)
    assert bool(layers) is (forced == FAST)
    runner = llm.engine.runner
    assert (runner.greedy_picks > 0, runner.head_gives_logits) == ((True, True) if forced == FAST else (False, None))


def test_a_failed_step_records_nothing(monkeypatch, measured):
    from hf_paged.engine.runner import ModelRunner

    llm = LLM(tiny_model("llama"), max_num_seqs=8)
    llm.add_request(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True))
    llm.engine.step()  # the prompt
    key = (llm.engine.runner.choice.signature, 1, torch.get_num_threads())
    step_choice.SETTLED.add(key)  # its one-row steps are tried from now on
    original = ModelRunner._run

    def broken(self, *args, **kwargs):
        raise RuntimeError("injected")
    monkeypatch.setattr(ModelRunner, "_run", broken)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="injected"):
            llm.engine.step()
    trial = TABLE.trials[key]
    assert trial.calls == 3 and not trial.warm, measured  # three trial steps, none recorded
    monkeypatch.setattr(ModelRunner, "_run", original)
    for _ in range(20):  # the first ones may run the products' own trials: not counted
        llm.engine.step()
        if trial.warm:
            break
    assert len(trial.warm) == 1 and not any(trial.times.values())


def test_the_benchmark_prints_the_choices(capsys):
    from hf_paged.bench.throughput_report import print_fused

    print_fused([{"requests": 4, "step_paths": [{"model": "LlamaForCausalLM", "rows": 4, "threads": 1,
                                                 "path": PLAIN, "ms": {FAST: 0.76, PLAIN: 0.7}}]}])
    out = capsys.readouterr().out
    assert "<=4 rows plain (fast 0.76 ms, plain 0.70 ms)" in out


def test_module_is_named_in_the_model_package():
    assert step_choice.TABLE is TABLE
