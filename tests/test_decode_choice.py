"""Which CPU decode attention runs (hf_paged/attention/decode_choice.py): a trial over the engine's pure decode calls
keeps the fastest of torch's path and the kernel's two paths (torch's unless beaten by more than the margin), drops
a far slower one early, is keyed per layer shape and thread count, honours the override, and an engine gives HF's
tokens whichever path it takes. Trial speeds are fed in, never measured."""
import pytest
import torch

import hf_paged
from hf_paged.attention import decode_choice
from hf_paged.attention.cpu_kernel import load_cpu_kernel
from hf_paged.tiny import tiny_model

pytestmark = pytest.mark.skipif(load_cpu_kernel() is None, reason="no C compiler here")


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.delenv(decode_choice.SWITCH, raising=False)
    decode_choice.TABLE.clear()
    yield
    decode_choice.TABLE.clear()


def drive(key, costs: dict[str, float], limit: int = 200) -> dict[str, int]:
    """Pure decode calls as the trial names them, each taking its cost, until the choice is made; calls per path."""
    calls = dict.fromkeys(costs, 0)
    for _ in range(limit):
        path, timed = decode_choice.pick(key, may_time=True)
        if not timed:
            return calls
        calls[path] += 1
        decode_choice.TABLE.record(key, path, costs[path])
    raise AssertionError("the trial never ended")


@pytest.mark.parametrize("costs, winner", [
    ({"torch": 10.0, "keys": 1.0, "vector": 0.8}, "vector"),
    ({"torch": 10.0, "keys": 0.8, "vector": 1.0}, "keys"),
    ({"torch": 10.0, "keys": 1.0, "vector": 1.0}, "keys"),  # ties go to the per-key path
    ({"torch": 1.0, "keys": 0.97, "vector": 0.99}, "torch"),  # within the margin: torch's path stays
])
def test_the_trial_keeps_the_fastest_and_drops_a_far_slower_path_early(costs, winner):
    key = decode_choice.key_of(torch.float32, 8, 2, 64, 16)
    calls = drive(key, costs)
    assert decode_choice.pick(key, may_time=True) == (winner, False)
    if costs["torch"] > 2 * min(costs.values()):
        assert calls["torch"] == 2  # a warm-up and one counted call
    (entry,) = decode_choice.decode_choices()
    assert entry["path"] == winner and entry["source"] == "measured" and set(entry["us"]) == set(costs)


def test_a_head_dim_without_the_vector_path_chooses_between_the_others():
    key = decode_choice.key_of(torch.bfloat16, 6, 3, 40, 16)
    calls = drive(key, {"torch": 3.0, "keys": 1.0})
    assert decode_choice.pick(key, may_time=True) == ("keys", False) and set(calls) == {"torch", "keys"}


def test_choices_are_per_shape_and_thread_count_and_other_calls_wait_untimed():
    key = decode_choice.key_of(torch.float32, 8, 2, 64, 16)
    assert decode_choice.pick(key, may_time=False) == ("auto", False)  # a mixed step: the kernel's default
    assert not decode_choice.TABLE.trials
    drive(key, {"torch": 10.0, "keys": 2.0, "vector": 1.0})
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        other = decode_choice.key_of(torch.float32, 8, 2, 64, 16)
        assert other != key and decode_choice.pick(other, may_time=True)[1]  # measured again
    finally:
        torch.set_num_threads(threads)
    assert decode_choice.pick(decode_choice.key_of(torch.float32, 8, 2, 64, 32), may_time=True)[1]


@pytest.mark.parametrize("setting, head_dim, path", [
    ("keys", 64, "keys"), ("vector", 64, "vector"), ("vector", 40, "keys"), ("torch", 64, "torch"),
    ("kernel", 64, "auto")])
def test_the_environment_forces_a_path(monkeypatch, setting, head_dim, path):
    monkeypatch.setenv(decode_choice.SWITCH, setting)
    assert decode_choice.pick(decode_choice.key_of(torch.float32, 8, 2, head_dim, 16), may_time=True) == (path, False)
    assert decode_choice.decode_choices()[0]["source"] == "forced"


@pytest.mark.parametrize("setting", [None, "keys", "vector", "torch"])
def test_an_engine_gives_hfs_tokens_on_every_path(monkeypatch, setting):
    """Greedy tokens against HF's own generate (fp32), measured or forced; measured, the engine's own decode steps
    ran the trial to its end."""
    if setting is not None:
        monkeypatch.setenv(decode_choice.SWITCH, setting)
    model = tiny_model("llama")
    llm = hf_paged.LLM(model, block_size=4, max_num_batched_tokens=16)
    prompts = [[5, 9, 13, 2, 7, 11, 3, 8, 21, 4, 6, 30, 12, 14, 15, 16, 17, 18, 19, 20, 22], [4, 4, 9]]
    outs = llm.generate(prompts, hf_paged.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    (entry,) = decode_choice.decode_choices()
    assert entry["source"] == ("forced" if setting else "measured")
    assert entry["path"] == (setting or entry["path"]) and entry["path"] in ("torch", "keys", "vector")
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None)
        assert list(out.outputs[0].token_ids) == want[0, len(prompt):].tolist()
