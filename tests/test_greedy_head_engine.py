"""The greedy LM head in the engine (hf_paged/model/greedy_head.py, engine/runner.py): steps where every request
takes its raw logits' argmax take picks, with HF's tokens; steps that need logits, models that change their head's
output, new weights and non-finite rows get the plain product."""
import pytest
import torch

import hf_paged
from hf_paged.model import greedy_head
from hf_paged.model.linear_choice import TABLE
from hf_paged.trials import SAMPLES

from conftest import cached_model

pytestmark = pytest.mark.skipif(not greedy_head.bf16_available(), reason="no oneDNN bf16 or no C compiler")

PROMPTS = [[5, 9, 14, 3, 77], [8, 8, 21], list(range(3, 40)), [100, 3, 50, 60, 70, 80, 90]]


@pytest.fixture(params=["force", "int8"])
def forced(monkeypatch, request):
    """Picks wherever the screen may run: the bf16 one, or the int8 one (these tests' heads see at most 16 rows)."""
    monkeypatch.setenv(greedy_head.SWITCH, request.param)
    yield request.param


def generate(model, params=None, prompts=PROMPTS, **options):
    llm = hf_paged.LLM(model, **options)
    params = params or hf_paged.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.token_ids) for o in outs], llm.engine.runner


def plain_tokens(model, params=None, prompts=PROMPTS):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(greedy_head.SWITCH, "0")
        tokens, runner = generate(model, params, prompts)
    assert runner.linears.greedy_head is None
    return tokens


def assert_picks_with_hfs_tokens(model):
    """The engine's greedy steps took the head's picks, and its tokens are those without picks and HF's own."""
    tokens, runner = generate(model)
    assert runner.head_gives_logits is True and runner.greedy_picks > 0
    assert tokens == plain_tokens(model)
    for prompt, row in zip(PROMPTS, tokens):
        want = model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert row == want[0, len(prompt):].tolist()


def test_the_engine_picks_on_greedy_steps_with_hfs_tokens(forced, one_torch_thread):
    model = cached_model("llama")
    assert_picks_with_hfs_tokens(model)


@pytest.mark.parametrize("params", [
    hf_paged.SamplingParams(max_tokens=8, temperature=0.0, logprobs=2),
    hf_paged.SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.3),
    hf_paged.SamplingParams(max_tokens=8, temperature=0.0, min_tokens=4),  # EOS banned for 4 steps
    hf_paged.SamplingParams(max_tokens=8, temperature=0.8, seed=3),
], ids=["logprobs", "penalty", "min_tokens", "sampling"])
def test_steps_that_need_logits_get_them(forced, params, one_torch_thread):
    model = cached_model("llama")
    tokens, runner = generate(model, params)
    if params.min_tokens:  # once EOS may be sampled, the argmax is all a step needs
        assert runner.greedy_picks > 0
        assert all(len(row) >= 4 for row in tokens)
    else:
        assert runner.greedy_picks == 0
    assert tokens == plain_tokens(model, params)


@pytest.mark.parametrize("in_place", [False, True])
def test_a_model_that_changes_its_heads_output_is_never_screened(forced, in_place, one_torch_thread):
    model = cached_model("llama")
    bias = torch.zeros(model.config.vocab_size)
    bias[17] = 1e4  # token 17 wins every step: the head's own argmax would not

    def hook(module, args, output):
        if in_place:
            output.logits.add_(bias)
        else:
            output.logits = output.logits + bias
        return output

    handle = model.register_forward_hook(hook)
    try:
        tokens, runner = generate(model)
        assert runner.head_gives_logits is False and runner.greedy_picks == 0
        assert all(set(row) == {17} for row in tokens)
    finally:
        handle.remove()


def test_a_change_after_the_check_is_refused_and_the_step_runs_again_with_logits(forced, one_torch_thread):
    """A model that changes its head's output after the check: the picking step is refused and undone, and the engine
    runs it again with real logits (no error reaches the caller); every later step computes logits."""
    model = cached_model("llama")
    llm = hf_paged.LLM(model)
    params = hf_paged.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm.generate(PROMPTS[:1], params, use_tqdm=False)
    runner = llm.engine.runner
    assert runner.head_gives_logits is True
    bias = torch.zeros(model.config.vocab_size)
    bias[17] = 1e4
    handle = model.register_forward_hook(lambda m, a, out: setattr(out, "logits", out.logits + bias) or out)
    try:
        engine = llm.engine
        engine.add_request(PROMPTS[1], params, request_id="r")
        finished = []
        while engine.has_unfinished:
            finished += [r for r in engine.step() if r.is_finished]
        assert runner.head_gives_logits is False
        assert finished[0].output_token_ids == [17] * 12  # the refused step's token too: computed from logits
    finally:
        handle.remove()


def test_a_model_returning_its_heads_output_made_contiguous_takes_picks(forced, one_torch_thread):
    """OPT's forward returns `lm_head(...).contiguous()`: the real logits come back as they are, and so does the
    picking steps' placeholder (its `.contiguous()` is itself): picks, HF's tokens."""
    from hf_paged.bench.models_census import tiny

    model = tiny("opt").eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    assert_picks_with_hfs_tokens(model)


def test_new_weights_give_new_picks(forced, one_torch_thread):
    model = cached_model("llama", seed=5)
    llm = hf_paged.LLM(model, enable_prefix_caching=False)
    params = hf_paged.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    first = [list(o.token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    head = model.get_output_embeddings()
    saved = head.weight.detach().clone()
    try:
        for change in ("optimizer", "data"):
            if change == "optimizer":  # the version counter moves
                with torch.no_grad():
                    head.weight.copy_(saved.roll(1, dims=0))
            else:  # `.data`: only the sampled entries show it
                head.weight.data.copy_(saved.roll(2, dims=0))
            got = [list(o.token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
            assert got != first
            assert got == plain_tokens(model, params)
    finally:
        with torch.no_grad():
            head.weight.copy_(saved)


def test_non_finite_hidden_states_end_requests_as_before(forced, one_torch_thread):
    model = cached_model("llama", seed=6)
    norm = model.model.norm.weight
    saved = norm.detach().clone()
    try:
        with torch.no_grad():
            norm[3] = float("nan")
        llm = hf_paged.LLM(model)
        outs = llm.generate(PROMPTS[:2], hf_paged.SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        assert all(o.outputs[0].finish_reason == "error" for o in outs)
        assert llm.engine.runner.greedy_picks == 0
    finally:
        with torch.no_grad():
            norm.copy_(saved)


def test_measured_mode_records_its_choice(monkeypatch, one_torch_thread):
    monkeypatch.delenv(greedy_head.SWITCH, raising=False)
    TABLE.clear()
    try:
        model = cached_model("llama")
        # enough greedy steps of 4 rows for a whole trial (1 + SAMPLES calls of each of three), the tokens right
        # throughout
        params = hf_paged.SamplingParams(max_tokens=3 * (2 + SAMPLES), temperature=0.0, ignore_eos=True)
        tokens, runner = generate(model, params)
        assert tokens == plain_tokens(model, params) and not [k for k in TABLE.trials if k.dtype == "greedy"]
        chosen = [c for c in TABLE.report() if c["dtype"] == "greedy"]
        products = {greedy_head.SCREEN, greedy_head.SCREEN8, greedy_head.PLAIN}
        assert chosen and {c["path"] for c in chosen} <= products
        assert all(set(c["us"]) == products for c in chosen)
    finally:
        TABLE.clear()


def test_hfs_generate_takes_picks_when_it_would_take_the_argmax(forced, engine_runs, one_torch_thread):
    """`model.generate(..., cache_implementation="paged")` greedy with no processors runs on the engine's own
    sampler: its steps take picks, with HF's tokens; with a processor they get logits."""
    from conftest import assert_same_as_hf, left_padded_batch

    model = cached_model("llama")
    ids, mask = left_padded_batch([5, 9, 3])
    assert_same_as_hf(model, ids, mask, max_new_tokens=8, do_sample=False)
    assert engine_runs[-1].engine.runner.greedy_picks > 0
    assert_same_as_hf(model, ids, mask, max_new_tokens=8, do_sample=False, repetition_penalty=1.3)
    assert engine_runs[-1].engine.runner.greedy_picks == 0


def test_a_runner_asks_no_picks_where_the_plain_head_was_chosen(monkeypatch, one_torch_thread):
    monkeypatch.delenv(greedy_head.SWITCH, raising=False)
    TABLE.clear()
    try:
        model = cached_model("llama")
        llm = hf_paged.LLM(model)
        head = llm.engine.runner.linears.greedy_head
        for rows in (1, 2, 4):
            TABLE.fast[(head.weight.shape, "greedy", rows, torch.get_num_threads(), True)] = greedy_head.PLAIN
        calls = []
        real = greedy_head.greedy_head_forward
        monkeypatch.setattr(greedy_head, "greedy_head_forward", lambda self, x: (calls.append(1), real(self, x))[1])
        params = hf_paged.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        llm.generate(PROMPTS, params, use_tqdm=False)
        assert llm.engine.runner.head_gives_logits is True and llm.engine.runner.greedy_picks == 0
        assert len(calls) == 1  # the checking step's; later steps run the head as without greedy steps
    finally:
        TABLE.clear()


def test_a_nan_in_the_checking_step_does_not_turn_the_screen_off(forced, one_torch_thread):
    """The check compares the head's output bit for bit: a request whose logits are NaN in the first greedy step
    ends alone, and later steps still take picks."""
    model = cached_model("llama", seed=7)
    llm = hf_paged.LLM(model)
    embed = model.get_input_embeddings().weight
    saved = embed[9].detach().clone()
    with torch.no_grad():
        embed[9] = float("nan")  # token 9 poisons its own request
    try:
        params = hf_paged.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        outs = llm.generate([[9, 4, 5], [6, 7, 8]], params, use_tqdm=False)
        assert outs[0].outputs[0].finish_reason == "error" and len(outs[1].outputs[0].token_ids) == 6
        assert llm.engine.runner.head_gives_logits is True and llm.engine.runner.greedy_picks > 0
    finally:
        with torch.no_grad():
            embed[9] = saved


def test_a_soft_capping_model_computes_logits(forced, one_torch_thread):
    """gemma2 soft-caps its logits after the head (tanh): the checking step sees a new tensor, so no picks; the
    tokens are HF's."""
    model = cached_model("gemma2")
    assert model.config.final_logit_softcapping
    tokens, runner = generate(model)
    assert runner.head_gives_logits is False and runner.greedy_picks == 0
    for prompt, row in zip(PROMPTS, tokens):
        want = model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert row == want[0, len(prompt):].tolist()


def test_a_step_that_samples_nothing_asks_no_picks(forced, one_torch_thread):
    """A chunked prompt's first chunks sample nothing: no picks are asked for (and nothing to check)."""
    model = cached_model("llama")
    prompts = [list(range(3, 60))]
    tokens, runner = generate(model, prompts=prompts, max_num_batched_tokens=16, enable_chunked_prefill=True)
    assert runner.head_gives_logits is True and runner.greedy_picks > 0
    assert tokens == plain_tokens(model, prompts=prompts)



def test_a_bf16_model_takes_int8_picks_with_its_logits_tokens(monkeypatch, one_torch_thread):
    """A bf16 head screens on its int8 copy (the picks: the first argmax of its bf16 logits), with the tokens of
    the plain head; its own packed copy stays."""
    from hf_paged.model import packed_linear

    monkeypatch.setenv(packed_linear.SWITCH, "force")  # the same products in both runs
    model = cached_model("llama", dtype=torch.bfloat16)
    monkeypatch.setenv(greedy_head.SWITCH, "int8")
    tokens, runner = generate(model)
    head = model.get_output_embeddings()
    assert runner.linears.greedy_head is head and runner.greedy_picks > 0 and runner.head_gives_logits is True
    assert packed_linear._INT8.get(head) is not None and packed_linear._COPIES.get(head) is not None
    assert tokens == plain_tokens(model)


@pytest.mark.parametrize("arch", ["qwen3_5_text", "nemotron_h"])
def test_a_refused_picking_step_of_a_hybrid_is_undone_before_it_runs_again(forced, arch, one_torch_thread):
    """The state layers advanced their slots in the refused step: running it again must start from the states before
    it (the step's undo), or every later token would come from states advanced twice. A head's output changed to an
    equal copy after the check: the engine's tokens stay those of a run without picks."""
    from hf_paged.tiny import tiny_hybrid

    model = tiny_hybrid(arch)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    params = hf_paged.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 14, 3, 77], [8, 8, 21, 40]]
    want = plain_tokens(model, params, prompts)
    llm = hf_paged.LLM(model)
    llm.generate(prompts[:1], params, use_tqdm=False)
    runner = llm.engine.runner
    assert runner.head_gives_logits is True
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=str(i))
    for _ in range(3):  # the prompts and two decode steps with picks: the refused step is a decode step
        engine.step()
    assert runner.head_gives_logits is True and runner.greedy_picks > 0
    handle = model.register_forward_hook(lambda m, a, out: setattr(out, "logits", out.logits + 0) or out)
    try:
        got = {}
        while engine.has_unfinished:
            for r in engine.step():
                if r.is_finished:
                    got[r.parent.request_id] = list(r.output_token_ids)
    finally:
        handle.remove()
    assert runner.head_gives_logits is False
    assert [got[str(i)] for i in range(len(prompts))] == want
