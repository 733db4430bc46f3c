"""Shared helpers: parity with HF generate on tiny random-weight models (built from configs, no downloads).

Forgiven divergences are bounded: a paged row may differ from HF only after a step where HF's own top-2 logit
margin was below MARGIN (a near tie that float rounding may flip), at most MAX_FORGIVEN_PER_CALL rows in one
`assert_same_as_hf` call (that call fails beyond it) and at most MAX_FORGIVEN_PER_SESSION in the whole session
(checked in `pytest_sessionfinish`, which then makes the session fail). Today the suite forgives none.

Without a CUDA device the GPU-only tests (every test marked `gpu`: all of tests/test_gpu.py, by its `pytestmark`)
are deselected at collection instead of reported as hundreds of skips; the terminal summary says in one line how
many were left out. (Interpreted-Triton and sm_90 / nvcc compile tests run on CPU and stay collected.)
"""
from __future__ import annotations

import functools
import math
import os

import pytest
import torch

import hf_paged  # noqa: F401  (registers the take-over)
from hf_paged.integrations.generate_run import GenerateRun
from hf_paged.tiny import tiny_model

MARGIN = 1e-3  # a divergence is forgiven only where HF's own top-2 logit margin was below this
MAX_FORGIVEN_PER_CALL = 1  # rows of one assert_same_as_hf call that may diverge on a near tie
MAX_FORGIVEN_PER_SESSION = 2  # the same, over the whole session
FORGIVEN: list[str] = []

HAS_CUDA = torch.cuda.is_available()
GPU_NOT_COLLECTED: list[str] = []  # node ids of the `gpu` tests deselected for want of a CUDA device


@functools.lru_cache(maxsize=None)
def cached_model(arch: str, **overrides):
    return tiny_model(arch, **overrides)


@pytest.fixture(scope="module")
def one_torch_thread():
    """The tiny models' matmuls are microseconds: one thread avoids spinning against a busy machine (restored)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def llama():
    return cached_model("llama")


@pytest.fixture
def engine_runs(monkeypatch):
    """Records every GenerateRun that actually ran on the engine."""
    runs = []
    original = GenerateRun.run

    def spy(self, engine):
        runs.append(self)
        self.engine = engine  # for tests that check how the engine scheduled the call
        return original(self, engine)

    monkeypatch.setattr(GenerateRun, "run", spy)
    return runs


def left_padded_batch(lengths: list[int], vocab: int = 256, seed: int = 0, pad: int = 0):
    """Random prompts (tokens 3..vocab-1, so no BOS/EOS/PAD inside) left-padded into one batch."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(3, vocab, (length,), generator=gen)
        mask[row, width - length:] = 1
    return ids, mask


def assert_same_as_hf(model, ids, mask, paged_kwargs=None, **gen_kwargs):
    """Run HF generate and the paged take-over on the same inputs and compare token for token.

    A row may differ only after a step where HF's own top-2 logit margin was < MARGIN (counted in FORGIVEN), and
    at most MAX_FORGIVEN_PER_CALL rows may. Returns the paged output.
    """
    ref = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, output_logits=True, **gen_kwargs)
    out = model.generate(ids, attention_mask=mask, cache_implementation="paged", **(paged_kwargs or {}), **gen_kwargs)
    expected = ref.sequences
    assert out.shape == expected.shape, f"shape {tuple(out.shape)} != HF {tuple(expected.shape)}"
    prompt_len = ids.shape[1]
    forgiven = []
    for row in range(expected.shape[0]):
        diff = (out[row] != expected[row]).nonzero()
        if len(diff) == 0:
            continue
        first = int(diff[0])
        assert first >= prompt_len, f"row {row}: prompt changed at {first}"
        top2 = ref.logits[first - prompt_len][row].topk(2).values
        margin = float(top2[0] - top2[1])
        assert margin < MARGIN, (f"row {row} diverges at new token {first - prompt_len} where HF's margin was "
                                 f"{margin:.4f}:\npaged {out[row].tolist()}\nHF    {expected[row].tolist()}")
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        forgiven.append(f"{test}: row {row} step {first - prompt_len} margin {margin:.2e}")
    FORGIVEN.extend(forgiven)
    assert len(forgiven) <= MAX_FORGIVEN_PER_CALL, (
        f"{len(forgiven)} rows diverge from HF on near ties (margin < {MARGIN}) in one call, more than the "
        f"{MAX_FORGIVEN_PER_CALL} allowed: {forgiven}")
    return out


def bf16_ulp(x: float) -> float:
    """The spacing of bfloat16 numbers at |x| (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 7)


def divergence_in_fp32(model32, prompt: list[int], a: list[int], b: list[int]):
    """Where two greedy continuations `a`, `b` of `prompt` first differ, how close the choice was in exact-ish math:
    (step, |logit(a[step]) - logit(b[step])|, the top logit's bf16 spacing), both by `model32` (a float32 copy of the
    model) on the shared prefix. None where they agree. A gap of a few bf16 spacings is a rounding flip of bf16."""
    assert len(a) == len(b), f"rows of {len(a)} and {len(b)} tokens: compare rows of equal length"
    step = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if step is None:
        return None
    ids = torch.tensor([list(prompt) + list(a[:step])], device=next(model32.parameters()).device)
    with torch.no_grad():
        logits = model32(ids).logits[0, -1].double()
    return step, abs(float(logits[a[step]] - logits[b[step]])), bf16_ulp(float(logits.max()))


def fp32_divergences(model, prompts, rows_a, rows_b) -> list:
    """(row, step, fp32 gap, bf16 spacing) for every row where `rows_a` and `rows_b` (greedy continuations of
    `prompts`) part, each judged by `divergence_in_fp32` on one float32 copy of `model`."""
    import copy

    model32 = copy.deepcopy(model).float()
    found = [(row, divergence_in_fp32(model32, p, a, b)) for row, (p, a, b) in enumerate(zip(prompts, rows_a, rows_b))]
    return [(row, *d) for row, d in found if d is not None]


def pytest_collection_modifyitems(config, items):
    """Without CUDA, tests marked `gpu` (all of tests/test_gpu.py, by its `pytestmark`) are deselected, not skipped."""
    if HAS_CUDA:
        return
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if item.get_closest_marker("gpu") is None]
    GPU_NOT_COLLECTED.extend(item.nodeid for item in gpu)


def pytest_sessionfinish(session, exitstatus):
    """More forgiven divergences than MAX_FORGIVEN_PER_SESSION fail the session, even if every test passed. Under
    pytest-xdist (the suite's default, `-n 2`) a worker hands its forgiven divergences and deselected GPU tests to
    the controller (`pytest_testnodedown`), which counts them for the whole session."""
    handed = getattr(session.config, "workeroutput", None)
    if handed is not None:  # an xdist worker
        handed["hf_paged_forgiven"] = list(FORGIVEN)
        handed["hf_paged_gpu_not_collected"] = list(GPU_NOT_COLLECTED)
        return
    if len(FORGIVEN) > MAX_FORGIVEN_PER_SESSION and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """The controller gathers what each xdist worker forgave and left out (every worker collects every test)."""
    handed = getattr(node, "workeroutput", {}) or {}
    FORGIVEN.extend(handed.get("hf_paged_forgiven", []))
    GPU_NOT_COLLECTED.extend(nodeid for nodeid in handed.get("hf_paged_gpu_not_collected", [])
                             if nodeid not in GPU_NOT_COLLECTED)


def pytest_terminal_summary(terminalreporter):
    if GPU_NOT_COLLECTED:
        terminalreporter.write_line(f"hf_paged: {len(GPU_NOT_COLLECTED)} GPU-only tests not collected (no CUDA device)")
    if FORGIVEN:
        over = len(FORGIVEN) > MAX_FORGIVEN_PER_SESSION
        terminalreporter.write_line(
            f"hf_paged parity: {'FAILED: ' if over else ''}{len(FORGIVEN)} divergence(s) forgiven (HF top-2 margin "
            f"< {MARGIN}; at most {MAX_FORGIVEN_PER_SESSION} allowed per session): {FORGIVEN}", red=over)


@pytest.fixture(autouse=True)
def fast_steps(monkeypatch):
    """Every step runs the CPU fast paths (`HF_PAGED_STEP_CHOICE=fast`): on these tiny models a measured choice
    (model/step_choice.py, tested in test_step_choice.py) would often run plain steps and leave the paths untested."""
    monkeypatch.setenv("HF_PAGED_STEP_CHOICE", "fast")


@pytest.fixture(autouse=True)
def checks_each_process(monkeypatch):
    """The start-up check runs in every process (`HF_PAGED_CHECK_CACHE=0`): a pass kept on disk by one test would
    hide what another test breaks on purpose (model/verdict_disk.py, tested in test_verdict_disk.py)."""
    monkeypatch.setenv("HF_PAGED_CHECK_CACHE", "0")


@pytest.fixture
def restore():
    """Puts back torch's thread count and hf_paged's take-over after a test that changes them (benchmark workers)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    hf_paged.enable()


def tiny_biogpt():
    """A tiny BioGPT: its learned position embedding takes the engine's positions (paged_forward.position_takers)."""
    import transformers as tf

    config = tf.BioGptConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=128, max_position_embeddings=256)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).eval()


def chunk_blind(right):
    """`paged_forward.sequence_positions` gone wrong only after cached context: a chunk of several tokens counts its
    positions from 0 (as a module counting from a cache length of 0 would); prefills and decodes stay `right`."""
    def positions(metadata):
        cu = metadata.cu_seqlens_q.long()
        query_lens = cu[1:] - cu[:-1]
        rows = metadata.slot_mapping.shape[0]
        within = torch.arange(rows, device=cu.device) - cu[:-1].repeat_interleave(query_lens)
        return torch.where(query_lens.repeat_interleave(query_lens) > 1, within, right(metadata))
    return positions


@pytest.fixture
def always_fast(monkeypatch):
    """State modules take every faster forward that agrees with their own, untimed (`HF_PAGED_STATE_FAST=fast`)."""
    monkeypatch.setenv("HF_PAGED_STATE_FAST", "fast")


def greedy_alone(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF `generate`'s greedy new tokens for each prompt run alone (no padding, EOS ignored)."""
    return [model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def exact_under_pressure(model, seed: int, modes=("recompute", "swap")) -> None:
    """Chunked prefill smaller than a prompt, preemption in each of `modes` (None: the engine's default), prefix hits
    (a state restored from a checkpoint): each run gives the greedy tokens of HF on each prompt alone."""
    gen = torch.Generator().manual_seed(seed)
    params = hf_paged.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 11, 17, 9)]
    for mode in modes:
        options = {} if mode is None else dict(preemption_mode=mode, swap_space=1 << 20)
        llm = hf_paged.LLM(model, num_blocks=10, block_size=4, max_num_batched_tokens=6, max_num_seqs=3,
                           long_prefill_token_threshold=4, **options)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == greedy_alone(model, prompts, 10)
        assert llm.engine.stats()["num_preemptions"] > 0
    shared = torch.randint(3, 256, (70,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 13)]
    llm = hf_paged.LLM(model, num_blocks=96, block_size=4)
    outs = [list(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids) for p in prompts]
    assert outs == greedy_alone(model, prompts, 10)
    assert llm.engine.stats()["prefix_cache_hit_tokens"] > 0


def wrong_substitute_refused(monkeypatch, entry: str, wrong, arch: str) -> None:
    """With state_fast's substitute `entry` made wrong (`wrong(substitute)` computes something else), the agreement
    check refuses it: every state module of a tiny `arch` hybrid keeps its own forward, and the engine stays exact."""
    from hf_paged.model import state_fast
    from hf_paged.model.state_modules import find_state_modules
    from hf_paged.tiny import tiny_hybrid

    make = state_fast.SUBSTITUTES[entry]
    monkeypatch.setitem(state_fast.SUBSTITUTES, entry, lambda original: wrong(make(original)))
    model = tiny_hybrid(arch)
    assert all(path is None for path in state_fast.fast_paths(model, find_state_modules(model)).values())
    ids, mask = left_padded_batch([4, 9])
    assert_same_as_hf(model, ids, mask, max_new_tokens=8, do_sample=False)
