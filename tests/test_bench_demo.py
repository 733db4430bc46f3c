"""bench/demo.py (`hf-paged demo`) piece by piece: its prompts, the KV pool it reserves, the HF padded baseline,
the printed report, and its exit code (1 only when the built-in model's outputs part from HF's).
(tests/test_cli.py runs the whole demo through the command line.)"""
from argparse import Namespace

import pytest
import torch

from hf_paged.bench import demo
from hf_paged.tiny import tiny_chat_model, tiny_tokenizer


def test_random_prompts_are_seeded_and_avoid_special_ids():
    prompts = demo.random_prompts(30, 50, seed=3, low=2, high=9)
    assert prompts == demo.random_prompts(30, 50, seed=3, low=2, high=9)
    assert prompts != demo.random_prompts(30, 50, seed=4, low=2, high=9)
    assert len(prompts) == 30 and all(2 <= len(p) <= 9 for p in prompts)
    assert {t for p in prompts for t in p} <= set(range(4, 50))  # ids 0-3: pad, bos, eos, unk
    assert {len(p) for p in prompts} == set(range(2, 10))  # both bounds reachable


def test_text_prompts_are_all_different_even_past_the_sentence_list():
    tokenizer = tiny_tokenizer(4096)
    count = len(demo.SENTENCES) + 3
    prompts = demo.text_prompts(tokenizer, count)
    assert len(prompts) == count and len({tuple(p) for p in prompts}) == count
    assert tokenizer.decode(prompts[0]).endswith(f"{demo.SENTENCES[0]} (variant 1)")
    assert tokenizer.decode(prompts[len(demo.SENTENCES)]).endswith(f"{demo.SENTENCES[0]} (variant 2)")


@pytest.mark.parametrize("lengths, max_tokens, block_size, blocks", [
    ([10], 6, 16, 2), ([16], 0, 16, 2), ([17], 0, 16, 3), ([5, 27, 1], 5, 8, 2 + 4 + 1 + 1)])
def test_needed_blocks_is_every_prompt_at_full_length_plus_one(lengths, max_tokens, block_size, blocks):
    assert demo.needed_blocks([[7] * n for n in lengths], max_tokens, block_size) == blocks


def test_show_quotes_and_cuts_long_text():
    assert demo.show("ab\nc") == "'ab\\nc'"
    cut = demo.show("x" * 500, limit=20)
    assert len(cut) == 20 and cut.endswith("...") and cut.startswith("'xxx")
    assert demo.show("y" * 18, limit=20) == "'" + "y" * 18 + "'"


def test_hf_padded_returns_exactly_the_new_tokens(one_torch_thread):
    model, _ = tiny_chat_model()
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12]]
    tokens, seconds = demo.hf_padded(model, prompts, 3, pad_id=0)
    assert [len(t) for t in tokens] == [3, 3] and seconds > 0
    alone = model.generate(torch.tensor([prompts[0]]), max_new_tokens=3, min_new_tokens=3, do_sample=False,
                           pad_token_id=0)
    assert tokens[0] == alone[0, 6:].tolist()  # the longest row has no padding: the same computation


class FakeLLM:
    def stats(self):
        return {"kv_cache_bytes": 8 * 2**20, "num_blocks_total": 16, "block_size": 16}


class CharTokenizer:
    def decode(self, ids):
        return "".join(chr(96 + i) for i in ids)


def test_report_prints_speed_identity_and_memory(capsys):
    demo.report(FakeLLM(), [[1, 2], [3]], [[4, 5], [6]], [[4, 5], [6]], 0.5, 2.0, 3, 4, CharTokenizer())
    out = capsys.readouterr().out
    assert "hf_paged LLM.generate" in out and "6.0" in out  # 3 tokens / 0.5 s
    assert "speed-up 4.00x; outputs identical to HF for 2/2 prompts; 3 engine steps per run" in out
    assert "can part" not in out
    assert "16 blocks of 16 tokens reserved for this workload (8.0 MiB), at most 4 in use at once (2.0 MiB)" in out
    assert "prompt 0 (2 tokens): 'ab'" in out and "hf_paged: 'de'" in out and "HF:       the same tokens" in out
    assert demo.NEXT_STEPS in out


def test_report_says_why_outputs_may_part(capsys):
    demo.report(FakeLLM(), [[1, 2], [3]], [[4, 5], [6]], [[4, 7], [6]], 1.0, 1.0, 3, 4, CharTokenizer())
    out = capsys.readouterr().out
    assert "identical to HF for 1/2 prompts" in out and "can part where two tokens score within rounding" in out
    assert "HF:       'dg'" in out


def args(**overrides):
    base = dict(requests=2, max_tokens=2, seed=0, device="cpu", dtype="auto", model=None)
    base.update(overrides)
    return Namespace(**base)


@pytest.mark.parametrize("builtin", [True, False])
def test_exit_code_fails_only_the_built_in_model_on_a_difference(monkeypatch, capsys, one_torch_thread, builtin):
    """The built-in fp32 model must match HF exactly; a model of one's own may flip near-ties."""
    real = demo.hf_padded
    monkeypatch.setattr(demo, "hf_padded", lambda *a: ([[t + 1 for t in row] for row in real(*a)[0]], 1.0))
    model, tokenizer = (None, None) if builtin else tiny_chat_model()
    assert demo.run_demo(model, tokenizer, args(), {"block_size": 16}) == (1 if builtin else 0)
    out = capsys.readouterr().out
    assert "identical to HF for 0/2 prompts" in out
    assert ("RANDOM weights" in out) == builtin


def test_pool_sized_to_the_workload_unless_given(monkeypatch, one_torch_thread, capsys):
    made = []
    import hf_paged

    real_llm = hf_paged.LLM
    monkeypatch.setattr(hf_paged, "LLM", lambda *a, **k: made.append(k) or real_llm(*a, **k))
    model, tokenizer = tiny_chat_model()
    assert demo.run_demo(model, tokenizer, args(requests=3), {"block_size": 8}) == 0
    prompts = demo.text_prompts(tokenizer, 3)
    assert made[-1]["num_blocks"] == demo.needed_blocks(prompts, 2, 8) and made[-1]["max_num_seqs"] == 3
    assert demo.run_demo(model, tokenizer, args(requests=3), {"block_size": 8, "num_blocks": 50}) == 0
    assert made[-1]["num_blocks"] == 50
