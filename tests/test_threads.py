"""Concurrent callers: several threads on one LLM, and two engines on one model."""
import threading

import torch

from hf_paged import LLM, PagedCache, SamplingParams

from conftest import cached_model

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def batches(count, seed):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randint(3, 256, (int(n),), generator=gen).tolist() for n in torch.randint(2, 30, (4,), generator=gen)]
            for _ in range(count)]


def run_threads(jobs):
    results, errors = [None] * len(jobs), []

    def work(i, job):
        try:
            results[i] = job()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i, job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    return results


def tokens(outputs):
    return [o.token_ids for o in outputs]


def test_threads_calling_generate_on_one_llm_get_their_own_right_outputs():
    model = cached_model("llama")
    work = batches(4, seed=11)
    expected = [tokens(LLM(model).generate(b, GREEDY, use_tqdm=False)) for b in work]
    llm = LLM(model, block_size=8, num_blocks=48)  # tight enough that the threads' requests preempt each other
    got = run_threads([lambda b=b: tokens(llm.generate(b, GREEDY, use_tqdm=False)) for b in work])
    assert got == expected
    llm.engine.check_idle()


def test_two_engines_on_one_model_leave_it_as_found():
    model = cached_model("llama")
    before = model.config._attn_implementation
    work = batches(2, seed=12)
    expected = [tokens(LLM(model).generate(b, GREEDY, use_tqdm=False)) for b in work]
    first, second = LLM(model), LLM(model)
    for _ in range(3):
        got = run_threads([lambda: tokens(first.generate(work[0], GREEDY, use_tqdm=False)),
                           lambda: tokens(second.generate(work[1], GREEDY, use_tqdm=False))])
        assert got == expected
    assert model.config._attn_implementation == before
    assert all("forward" not in vars(m) for m in model.modules())  # no swapped linear forward left behind
    ids = torch.tensor([work[0][0]])
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)  # plain HF works


def test_a_model_hf_paged_ran_can_be_copied_and_saved(tmp_path):
    """copy.deepcopy(model) and torch.save(model) (reference models, EMA copies, checkpoints) work after hf_paged ran
    the model: the copy gets its own forward lock and generates the same tokens; the checkpoint holds no lock and
    loads in a process that never imports hf_paged."""
    import copy
    import subprocess
    import sys

    from hf_paged.model import forward_lock
    from hf_paged.tiny import tiny_model

    model = tiny_model("llama")
    ids = torch.tensor([[5, 9, 30, 7, 11]])
    expected = model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="paged")
    model.generate(ids, max_new_tokens=3, num_beams=2, cache=PagedCache(model.config))  # HF's loop, pages in place
    LLM(model).generate([[5, 6, 7]], GREEDY, use_tqdm=False)  # every path that leaves state on the model ran
    assert {"_hf_paged_forward_lock", "_hf_paged_reads_in_place", "_hf_paged_kv_shape"} <= set(vars(model))
    path = tmp_path / "model.pt"
    torch.save(model, path)
    code = ("import sys, torch; m = torch.load(sys.argv[1], weights_only=False); "
            "assert 'hf_paged' not in sys.modules, 'loading needed hf_paged'; "
            "print(m.generate(torch.tensor([[5, 9, 30, 7, 11]]), max_new_tokens=6, do_sample=False).tolist())")
    plain = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert plain.stdout.strip() == str(expected.tolist())
    loaded = torch.load(path, weights_only=False)
    for other in (copy.deepcopy(model), loaded):
        assert torch.equal(other.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="paged"),
                           expected)
        assert forward_lock(other) is not forward_lock(model) and forward_lock(other) is forward_lock(other)


def test_a_copy_taken_in_the_middle_of_a_forward_is_never_silently_wrong(monkeypatch):
    """A deepcopy taken while an engine's forward runs (here from a hook inside it; in life, another thread) carries
    that forward's swapped linear forwards, bound to the copy's own modules (never computing with the original's
    weights), switched on for the engine's thread only (the copy computes as nn.Linear) and dropped when the copy is
    first used. Its config was never written (the switch is per thread): the copy is served like the original.
    (The forced kernel swaps the linears in every step; measured, a step whose products are all F.linear swaps none.)"""
    import copy

    monkeypatch.setenv("HF_PAGED_SMALL_LINEARS", "kernel")
    for switch in ("HF_PAGED_FUSED_NORMS", "HF_PAGED_FUSED_ROTARY"):  # swapped in every step too, whatever the timing
        monkeypatch.setenv(switch, "force")
    from hf_paged.model.fused_norms import verified_lanes
    from hf_paged.model.fused_rotary import verified

    verified_lanes.cache_clear()
    verified.cache_clear()

    from hf_paged.tiny import tiny_model

    model = tiny_model("llama")
    copies = []

    def take_copy(module, args, output):
        if not copies and "forward" in vars(model.lm_head):  # the first forward that runs with swapped linears
            copies.append(copy.deepcopy(model))

    hook = model.model.layers[0].register_forward_hook(take_copy)
    expected = tokens(LLM(model).generate([[5, 9, 30, 7, 11]], GREEDY, use_tqdm=False))
    hook.remove()
    twin = copies[0]
    twin.model.layers[0]._forward_hooks.clear()
    leftover = vars(twin.lm_head)["forward"]
    assert leftover.__self__ is twin.lm_head  # bound to the copy: its own weights
    norm, rotary = twin.model.norm, next(iter(vars(twin.model.layers[0].self_attn)["_kernel_funcs"].values()))
    assert vars(norm)["forward"].__self__ is norm and vars(rotary)["forward"].__self__ is rotary
    ids = torch.tensor([[5, 9, 30, 7, 11]])
    with torch.inference_mode():
        assert torch.equal(twin(ids).logits, model(ids).logits)  # the leftovers are off: nn.Linear's sums
    assert twin.config._attn_implementation == "sdpa" and not [k for k in vars(twin.config) if "hf_paged" in k]
    assert tokens(LLM(twin).generate([[5, 9, 30, 7, 11]], GREEDY, use_tqdm=False)) == expected
    assert "forward" not in vars(twin.lm_head) and "forward" not in vars(norm)  # dropped on first use
    assert "forward" not in vars(rotary)
    assert model.config._attn_implementation == "sdpa" and not [k for k in vars(model.config) if "hf_paged" in k]
    assert tokens(LLM(copy.deepcopy(model)).generate([[5, 9, 30, 7, 11]], GREEDY, use_tqdm=False)) == expected
