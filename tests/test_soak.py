"""The soak test (hf_paged/bench/soak.py) in CI size: the same code path, a few rounds, zero violations (also with each
extra mode: faults, consumers, weight changes, fp8; and on a hybrid model with state layers, alone and taking turns
with a mixed sliding-window / full-attention model); the reproducers of the bugs it found; proof that its checks catch
a broken engine; and that each fault point it adds on state models is reached and atomic."""
import importlib.util
import random

import pytest

from hf_paged import LLM, SamplingParams
from hf_paged.bench import soak, soak_check, soak_draw, soak_faults, soak_round
from hf_paged.engine.scheduler import Scheduler

from conftest import cached_model


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield


@pytest.fixture(scope="module")
def model():
    return cached_model("llama", max_len=soak_draw.MAX_LEN)


def test_soak_has_no_violations(model):
    """Up to 800 random requests over recompute / swap / auto rounds (new rounds start for at most 24 s)."""
    report = soak.run_soak(requests=800, minutes=0.4, seed=11, model=model)
    assert report["violations"] == []
    assert all(report[k] == 0 for k in soak_check.VIOLATION_COUNTS), report
    # it really exercised what it is for
    assert report["rounds"] >= 3 and report["compared"] > 100, report
    assert report["preemptions"] > 0 and report["swap_outs"] > 0 and report["recomputed_tokens"] > 0, report
    assert report["aborts"] > 0 and report["prefix_hit_tokens"] > 0, report


def test_a_rounding_tie_is_told_from_a_real_difference(model):
    """Found by a 15-minute soak (seed 1204, 87,272 samples compared): in round 485 a seeded sample (temperature 1.5,
    top-k 50) drew token 86 on the pressured engine and 27 on the reference at its third token. The logits differed by
    6e-7 (another summation order), and the exponential race had the two within one float32 step. `flip_gap` says
    so; a token the race did not nearly tie is far apart, and so is a greedy flip between tokens of unequal logits."""
    seed, number = 1204, 485
    rng = random.Random(seed)
    systems = [[rng.randrange(3, soak_draw.VOCAB) for _ in range(n)] for n in soak_draw.SYSTEM_LENGTHS]
    size = random.Random(f"{seed}/{number}/size").randint(20, 80)
    spec = soak_draw.draw_round(random.Random(f"{seed}/{number}"), systems, number, size)[21]
    assert spec.params.seed == 1290690778 and spec.params.temperature == 1.5  # the request the soak reported
    gap, limit = soak_check.flip_gap(model, spec, 0, [40, 81], (86, 27))
    assert gap < limit
    gap, limit = soak_check.flip_gap(model, spec, 0, [40, 81], (86, 118))  # the race's third place
    assert gap > 100 * limit
    gap, limit = soak_check.flip_gap(model, spec, 1, [40, 81], (86, 27))  # another sample's noise
    assert gap > 100 * limit
    greedy = soak_draw.Spec("g", spec.prompt, SamplingParams(max_tokens=4, temperature=0.0))
    assert soak_check.flip_gap(model, greedy, 0, [], (86, 27))[0] > 100 * soak_check.NEAR_TIE["greedy"]


# ---- reproducers of the bugs the soak found ------------------------------------------------------------------------
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def unpressured(model, prompts, params):
    return [[c.token_ids for c in o.outputs] for o in LLM(model).generate(prompts, params, use_tqdm=False)]


def test_samples_sharing_a_first_block_on_a_one_block_pool(model):
    """Copy-on-write of a shared block at table index 0 was not counted (`1 if index else 0`), so the scheduler
    thought it fitted and the pool raised `RuntimeError: asked for 1 KV blocks, only 0 free`."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, n=2)
    llm = LLM(model, block_size=16, num_blocks=1)
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == unpressured(model, [[5, 6, 7]], params)[0]
    assert llm.stats()["num_preemptions"] == 1
    llm.engine.check_idle()


def test_swap_out_in_the_step_that_copied_on_write(model):
    """Sample 0 of a prompt copies its shared partial block on its first write; in the same step a more important
    request needs blocks, sample 1 and then sample 0 are swapped out. Swap-outs run before copy-on-write copies, so
    sample 0's host copy was taken from the still-empty copy: its tokens went wrong after the swap-in."""
    long, short = list(range(10, 26)), [40, 41, 42, 43, 44, 45]
    params = [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, n=2)]
    llm = LLM(model, block_size=4, num_blocks=5, long_prefill_token_threshold=8, preemption_mode="swap",
              swap_space=1 << 20, attention_backend="torch")
    outs = llm.generate([long, short], params, use_tqdm=False, priority=[0, 1])
    assert llm.stats()["num_swap_outs"] >= 2
    assert [[c.token_ids for c in o.outputs] for o in outs] == unpressured(model, [long, short], params)
    llm.engine.check_idle()


# ---- the soak's checks catch a broken engine -------------------------------------------------------------------
def corrupt_preempted_tokens(monkeypatch):
    """A preempted request's next tokens change (as if its K/V were restored wrongly)."""
    import hf_paged.engine.scheduler as scheduler

    original = scheduler.apply_stop_rules

    def broken(request, token, *args):
        return original(request, (token + 1) % 256 if request.num_preemptions else token, *args)

    monkeypatch.setattr(scheduler, "apply_stop_rules", broken)


def leak_aborted(monkeypatch):
    """An aborted request leaves the queues but keeps its blocks and swap slots."""
    original = Scheduler._release

    def broken(self, request):
        if request.finish_reason != "abort":
            return original(self, request)
        for queue in (self.running, self.waiting):
            if request in queue:
                queue.remove(request)

    monkeypatch.setattr(Scheduler, "_release", broken)


def drop_finished(monkeypatch):
    """A sample that finishes in a step where another one also finishes is never reported."""
    original = LLM.step

    def broken(self):
        outs = original(self)
        finished = [o for o in outs if o.outputs[0].finish_reason is not None]
        return [o for o in outs if o not in finished[1:]]

    monkeypatch.setattr(LLM, "step", broken)


@pytest.mark.parametrize("breakage, kinds", [(corrupt_preempted_tokens, ["mismatches"]), (drop_finished, ["lost"]),
                                             (leak_aborted, ["leaks", "exceptions"])])  # a full pool stalls
def test_the_soak_catches(model, monkeypatch, breakage, kinds):
    breakage(monkeypatch)
    report = soak.run_soak(requests=150, seed=11, model=model)
    assert sum(report[kind] for kind in kinds) > 0, report


# ---- the extra modes ------------------------------------------------------------------------------------------------
def test_the_fault_points_are_the_step_matrix():
    """The soak injects faults at the points tests/test_step_atomic.py proves atomic (it reads the soak's list), and
    each one names a callable that exists."""
    points = soak_faults.POINTS
    assert len(points) == len(set(points)) >= 23
    assert not set(points) & set(soak_faults.STATE_POINTS)  # those only on models with state layers
    for module_name, path in points + soak_faults.STATE_POINTS:
        owner = importlib.import_module(module_name)
        for name in path.split("."):
            owner = getattr(owner, name)


MODES = {"faults": (dict(faults=True), "faults"), "consumers": (dict(consumers=4), "consumers"),
         "weight_changes": (dict(weight_changes=True), "session"), "fp8": (dict(fp8=True), "fp8")}


def run_mode(model, monkeypatch, mode, requests=220, seed=12):
    """A soak whose every round takes `mode` (where it can: faults in stream rounds only)."""
    options, rate = MODES[mode]
    monkeypatch.setitem(soak_round.RATES, rate, 1.0)
    return soak.run_soak(requests=requests, seed=seed, model=model, **options)


@pytest.mark.parametrize("mode", MODES)
def test_soak_with_an_extra_mode_has_no_violations(model, monkeypatch, mode):
    report = run_mode(model, monkeypatch, mode)
    assert report["violations"] == []
    assert all(report[k] == 0 for k in soak_check.VIOLATION_COUNTS), report
    assert report["compared"] > 100, report
    if mode == "faults":
        assert report["fault_rounds"] > 0 and report["faults_hit"] > 0, report
    elif mode == "consumers":
        assert report["consumer_rounds"] > 0, report
    elif mode == "weight_changes":
        assert report["weight_changes"] > 0 and report["weight_rounds"] > report["weight_changes"], report
    else:
        assert report["fp8_rounds"] > 0, report


def test_the_soak_catches_a_step_that_is_not_undone(model, monkeypatch):
    """With the step's rollback doing nothing, a failed step keeps what it did half-way: the fault rounds report it."""
    undo = importlib.import_module("hf_paged.engine.step_undo").StepUndo \
        if importlib.util.find_spec("hf_paged.engine.step_undo") else Scheduler  # where `rollback` lives
    monkeypatch.setattr(undo, "rollback", lambda self: None)
    report = run_mode(model, monkeypatch, "faults")
    assert report["faults_hit"] > 0
    assert sum(report[k] for k in soak_check.VIOLATION_COUNTS) > 0, report


def test_the_soak_catches_stale_prefix_hits_after_weight_changes(model, monkeypatch):
    """An engine that keys its cached K/V by tokens only (not by the weights that produced them) serves the old
    weights' K/V to the next round's shared prompts."""
    from hf_paged.engine.engine import Engine

    monkeypatch.setattr(Engine, "kv_context", lambda self: ())
    monkeypatch.setattr(Engine, "reset_prefix_cache", lambda self: None)
    report = run_mode(model, monkeypatch, "weight_changes")
    assert report["weight_changes"] > 0 and report["mismatches"] > 0, report


def test_the_soak_catches_results_handed_to_another_consumer(model, monkeypatch):
    """`step()` callers given the requests of generate / stream calls as well."""
    monkeypatch.setattr(LLM, "_unclaimed", lambda self, request_id: True)
    report = run_mode(model, monkeypatch, "consumers")
    assert report["consumer_rounds"] > 0 and report["foreign"] + report["exceptions"] > 0, report


# ---- other models: hybrid (state layers) and mixed sliding / full attention -------------------------------------
@pytest.fixture(scope="module")
def hybrid():
    from hf_paged.tiny import tiny_hybrid

    return tiny_hybrid("qwen3_5_text")  # Gated DeltaNet state layers and a full-attention layer


def test_soak_on_a_hybrid_model_has_no_violations(hybrid, monkeypatch):
    """A few small rounds on a hybrid model through recompute / swap / auto, every stream round with injected faults
    and every round drawn for fp8 (refused on state layers: run unquantized, noted): outputs as on an unpressured
    engine, and after each round every block and every state slot is free (`check_idle`)."""
    monkeypatch.setitem(soak_round.RATES, "faults", 1.0)
    monkeypatch.setitem(soak_round.RATES, "fp8", 1.0)
    report = soak.run_soak(requests=27, seed=3, model=hybrid, faults=True, fp8=True, round_sizes=(9, 9))
    assert report["violations"] == []
    assert all(report[k] == 0 for k in soak_check.VIOLATION_COUNTS), report
    assert report["rounds"] >= 3 and report["compared"] > 20, report
    assert report["recomputed_tokens"] > 0 and report["swap_outs"] > 0 and report["faults_hit"] > 0, report
    assert report["fp8_rounds"] == 0 and report["fp8_skipped"] == report["rounds"] and report["notes"], report


def test_soak_rotates_models(hybrid):
    """`model` as a list: the models take the rounds in turn, each one round per preemption mode in a row (a mixed
    sliding-window / full-attention Gemma 3 with an 8-token window here: most prompts cross it)."""
    gemma3 = soak.mixed_window_model()
    assert set(gemma3.config.layer_types) == {"sliding_attention", "full_attention"}
    report = soak.run_soak(requests=18, seed=4, model=[gemma3, hybrid], round_sizes=(3, 3))
    assert report["violations"] == []
    assert all(report[k] == 0 for k in soak_check.VIOLATION_COUNTS), report
    rounds = report["model_rounds"]  # a generate() round leaves out the requests drawn to be aborted: 6 rounds or more
    assert set(rounds) == {"gemma3_text", "qwen3_5_text"} and min(rounds.values()) == 3, report


@pytest.mark.parametrize("method", ["copy", "load"])
def test_the_soak_catches_a_state_not_carried_over(hybrid, monkeypatch, method):
    """A fork that does not copy its parent's state (`copy`), a swap-in that does not restore the saved state
    (`load`): the slot holds another sequence's state or zeros, and the tokens differ from the unpressured run."""
    from hf_paged.kv.state import StateSlots

    monkeypatch.setattr(StateSlots, method, lambda self, *args: None)
    report = soak.run_soak(requests=12, seed=3, model=hybrid, round_sizes=(6, 6))
    assert report["mismatches"] > 0, report


def test_the_soak_catches_a_leaked_state_slot(hybrid, monkeypatch):
    """A state slot never given back (its request's blocks are) is a leak at the end of the round."""
    from hf_paged.kv.state import StateSlots

    monkeypatch.setattr(StateSlots, "free", lambda self, slot: None)
    report = soak.run_soak(requests=4, seed=3, model=hybrid, round_sizes=(4, 4))
    assert report["leaks"] > 0 and any("state slots" in v for v in report["violations"]), report


SHARED = list(range(10, 34))  # six blocks of 4: checkpointed by a first request, hit by the later ones
STATE_PROMPTS = [SHARED + [40, 41], list(range(60, 90)), SHARED + [50]]
STATE_PARAMS = [SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, n=2),
                SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                SamplingParams(max_tokens=5, temperature=1.0, seed=7, ignore_eos=True)]
# a fork, prefix hits from state checkpoints taken at every block boundary, swaps (the samples outgrow the pool)
STATE_OPTIONS = dict(block_size=4, num_blocks=16, max_num_batched_tokens=16, max_num_seqs=8, preemption_mode="swap",
                     swap_space=1 << 20, attention_backend="torch", state_checkpoint_interval=1)


@pytest.fixture(scope="module")
def state_expected(hybrid):
    outs = soak_check.reference_engine(hybrid).generate(STATE_PROMPTS, STATE_PARAMS, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("index", range(len(soak_faults.STATE_POINTS)),
                         ids=[p[1] for p in soak_faults.STATE_POINTS])
def test_a_failed_step_at_a_state_point_changes_nothing(hybrid, state_expected, monkeypatch, index):
    """Each point the soak adds on state models is reached by a small workload (fork, checkpoint hits, swap out and
    in), and a step failing there (before or after it did its work, Exception or KeyboardInterrupt) changes nothing:
    stepping on gives the unpressured tokens, every block and state slot free at the end."""
    module_name, path = soak_faults.STATE_POINTS[index]
    when, error = ("before", KeyboardInterrupt()) if index % 2 else ("after", soak_faults.InjectedFault("injected"))
    owner_name, _, name = path.rpartition(".")
    owner = getattr(importlib.import_module(module_name), owner_name)
    original, calls = getattr(owner, name), [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 1 and when == "before":
            raise error
        result = original(*args, **kwargs)
        if calls[0] == 1 and when == "after":
            raise error
        return result

    llm = LLM(hybrid, **STATE_OPTIONS)
    llm.generate([SHARED + [99]], SamplingParams(max_tokens=1), use_tqdm=False)  # the shared blocks' checkpoints
    for i, (prompt, params) in enumerate(zip(STATE_PROMPTS, STATE_PARAMS)):
        llm.add_request(prompt, params, request_id=str(i))
    monkeypatch.setattr(owner, name, wrapped)
    ended, raised = {}, False
    while llm.has_unfinished_requests():
        try:
            outs = llm.step()
        except BaseException as e:  # noqa: BLE001 - the injected error, whatever its class
            if e is not error:
                raise
            raised = True
            monkeypatch.undo()
            continue
        for out in outs:
            for c in out.outputs:
                if c.finish_reason is not None:
                    assert (out.request_id, c.index) not in ended
                    ended[(out.request_id, c.index)] = c.token_ids
    monkeypatch.undo()
    assert raised, f"{path} was never reached: the case tests nothing"
    assert [[ended.get((str(i), k)) for k in range(p.n)] for i, p in enumerate(STATE_PARAMS)] == state_expected
    llm.engine.check_idle()
    assert llm.stats()["num_swap_outs"] > 0 and llm.stats()["prefix_cache_hit_tokens"] > 0
