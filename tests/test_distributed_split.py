"""Data parallel that cannot cross outputs: under `torchrun` (2 CPU processes, gloo) each `LLM.generate` / paged
pipeline call splits its prompts over the processes only when every process passed the same ones; with accelerate's
`split_between_processes` (even, uneven, an empty share) every process gets exactly the outputs one process gives for
its own prompts. Each scenario is compared with single-process runs of the same calls (request ids included).

One torchrun launch runs every scenario (this file is also its worker script); a failing scenario is recorded, not
raised, so the others still run and each test names its own. The launch must exit 0 on both processes: the process
group hf_paged started is destroyed at exit (checked by a hook that runs after hf_paged's).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from test_distributed import MAX_TOKENS, PROMPTS, params, torchrun

EVEN = PROMPTS[:4]  # 2 + 2
UNEVEN = PROMPTS[4:7]  # 2 + 1
EMPTY = PROMPTS[7:8]  # 1 + 0
PIPELINE = ["abc", "pagedAttention42", "kv"]  # 2 + 1


def own_params(prompts):
    """Per-prompt parameters (seeded sampling for one of them), a function of the prompt alone."""
    from hf_paged import SamplingParams

    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, n=2, seed=3)
    return [sampled if p == "pagedAttention42" else greedy for p in prompts]


def described(outs) -> list:
    return [[o.request_id, o.prompt, [[c.token_ids, c.text, c.finish_reason] for c in o.outputs]] for o in outs]


def calls(shares: dict) -> list[tuple[str, list]]:
    """(scenario, this process's prompts) of every generate call, in the order the worker makes them."""
    return [("same", PROMPTS)] + [(name, shares[name]) for name in ("even", "uneven", "empty")]


def split_worker(out_dir: str) -> None:
    import atexit
    import os

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from accelerate import PartialState
    from hf_paged import LLM
    from hf_paged.tiny import tiny_model
    from test_pipeline import make_tokenizer
    from transformers import pipeline

    # registered before hf_paged starts the process group, so it runs after hf_paged's exit hook
    atexit.register(lambda: Path(out_dir, f"exit{os.environ['RANK']}").write_text(str(dist.is_initialized())))
    model, tok = tiny_model("llama"), make_tokenizer()
    llm = LLM(model, tok)  # starts the process group (through accelerate)
    state = PartialState(cpu=True)
    result: dict = {"rank": llm.world.rank, "shares": {}, "outputs": {}}

    def scenario(name, prompts, run):
        result["shares"][name] = list(prompts)  # what this process passed
        try:
            result["outputs"][name] = run(list(prompts))
        except Exception as e:  # noqa: BLE001 - recorded for the test that checks this scenario
            result["outputs"][name] = f"{type(e).__name__}: {e}"

    for name, everyone in [("even", EVEN), ("uneven", UNEVEN), ("empty", EMPTY), ("pipeline", PIPELINE)]:
        with state.split_between_processes(everyone) as mine:
            result["shares"][name] = list(mine)
    before = llm.stats()["num_prompt_tokens"]
    for name, prompts in calls(result["shares"]):
        chosen = params() if name == "same" else own_params(prompts)
        scenario(name, prompts, lambda p, chosen=chosen: described(llm.generate(p, chosen, use_tqdm=False)))
        if name == "same":
            result["same_prompt_tokens"] = llm.stats()["num_prompt_tokens"] - before
    pipe = pipeline("text-generation", model=model, tokenizer=tok, batch_size=4)
    scenario("pipeline", result["shares"]["pipeline"],
             lambda p: pipe(p, max_new_tokens=MAX_TOKENS, do_sample=False, cache_implementation="paged"))
    Path(out_dir, f"split{llm.world.rank}.json").write_text(json.dumps(result))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("torchrun_split")
    torchrun(out_dir, __file__)
    ranks = [json.loads(Path(out_dir, f"split{r}.json").read_text()) for r in range(2)]
    return ranks, [Path(out_dir, f"exit{r}").read_text() for r in range(2)]


@pytest.fixture(scope="module")
def expected(ranks, one_torch_thread):
    """Per rank: what one process gives for that rank's own calls, made in the same order on a fresh LLM."""
    from hf_paged import LLM
    from hf_paged.tiny import tiny_model
    from test_pipeline import make_tokenizer
    from transformers import pipeline

    model, tok = tiny_model("llama"), make_tokenizer()
    pipe = pipeline("text-generation", model=model, tokenizer=tok, batch_size=4)
    per_rank = []
    for result in ranks[0]:
        llm = LLM(model, tok)
        assert not llm.world.is_parallel
        outs = {name: described(llm.generate(prompts, params() if name == "same" else own_params(prompts),
                                             use_tqdm=False)) for name, prompts in calls(result["shares"])}
        outs["pipeline"] = pipe(result["shares"]["pipeline"], max_new_tokens=MAX_TOKENS, do_sample=False,
                                cache_implementation="paged")
        per_rank.append(json.loads(json.dumps(outs)))
    return per_rank


def check(ranks, expected, name: str, sizes: list[int]) -> None:
    results = ranks[0]
    assert [len(r["shares"][name]) for r in results] == sizes  # accelerate's split, as the scenario means it
    for rank, (result, wanted) in enumerate(zip(results, expected)):
        got = result["outputs"][name]
        assert got == wanted[name], f"rank {rank} ({name}): {str(got)[:300]} != {str(wanted[name])[:300]}"


def test_even_split_between_processes(ranks, expected):
    check(ranks, expected, "even", [2, 2])


def test_uneven_split_between_processes(ranks, expected):
    check(ranks, expected, "uneven", [2, 1])


def test_a_rank_with_no_prompts(ranks, expected):
    check(ranks, expected, "empty", [1, 0])


def test_pipeline_with_different_inputs_per_rank(ranks, expected):
    check(ranks, expected, "pipeline", [2, 1])


def test_same_prompts_everywhere_still_split(ranks, expected, one_torch_thread):
    from hf_paged import LLM
    from hf_paged.tiny import tiny_model
    from test_pipeline import make_tokenizer

    check(ranks, expected, "same", [len(PROMPTS)] * 2)
    llm = LLM(tiny_model("llama"), make_tokenizer())
    llm.generate(PROMPTS, params(), use_tqdm=False)
    total = llm.stats()["num_prompt_tokens"]
    shares = [r["same_prompt_tokens"] / total for r in ranks[0]]
    assert all(0.35 <= share <= 0.65 for share in shares) and sum(r["same_prompt_tokens"] for r in ranks[0]) == total


def test_the_process_group_hf_paged_started_is_destroyed_at_exit(ranks):
    assert ranks[1] == ["False", "False"]  # still initialized after hf_paged's exit hook: it did not run


def test_inputs_digest_is_canonical():
    import torch
    from hf_paged import SamplingParams
    from hf_paged.distributed import inputs_digest
    from transformers.pipelines.text_generation import ReturnType

    class Chat:  # as transformers' pipeline wraps a chat
        def __init__(self, messages):
            self.messages = messages

    value = [[1, 2], "ab", SamplingParams(temperature=0.5), {"b": 1, "a": None}, Chat([{"role": "user"}])]
    assert inputs_digest(value) == inputs_digest(json.loads(json.dumps(value[:2])) + value[2:]) is not None
    for changed in ([1, 3], "ab ", SamplingParams(temperature=0.6), {"b": 1, "a": 0}, Chat([{"role": "system"}])):
        other = [changed if type(v) is type(changed) else v for v in value]
        assert inputs_digest(other) != inputs_digest(value)
    assert inputs_digest([1, 2]) != inputs_digest((1, 2)) != inputs_digest("[1, 2]")
    assert inputs_digest(ReturnType.NEW_TEXT) == inputs_digest(ReturnType(1)) != inputs_digest(ReturnType.FULL_TEXT)
    long = torch.zeros(5000)
    assert inputs_digest(long) != inputs_digest(torch.cat([long[:2000], torch.ones(1), long[2001:]]))  # no elision
    assert inputs_digest([print]) is None and inputs_digest([lambda: 0]) is None  # never split on those


def test_single_process_generate_makes_no_collective(monkeypatch, one_torch_thread):
    import hf_paged.distributed as distributed
    from hf_paged import LLM
    from hf_paged.tiny import tiny_model
    from test_pipeline import make_tokenizer

    monkeypatch.setattr(distributed, "_all_equal", lambda *a: pytest.fail("a collective in a single-process run"))
    outs = LLM(tiny_model("llama"), make_tokenizer()).generate(["ab", "c"], params()[:2], use_tqdm=False)
    assert [o.prompt for o in outs] == ["ab", "c"]


if __name__ == "__main__":
    split_worker(sys.argv[1])
