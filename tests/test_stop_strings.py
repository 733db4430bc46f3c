"""`SamplingParams.stop`: a request ends when its text contains a stop string, and each step decodes only a tail."""
from hf_paged import LLM, SamplingParams


class LetterTokenizer:
    """A tokenizer with no download: token t is the letter chr(97 + t % 26), every 7th token a space; records the
    length of every decode call."""

    eos_token_id = None

    def __init__(self):
        self.decoded_lengths: list[int] = []

    def decode(self, token_ids, skip_special_tokens=True):
        self.decoded_lengths.append(len(token_ids))
        return "".join(" " if t % 7 == 0 else chr(97 + t % 26) for t in token_ids)

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) - 97 + 26 for c in text]}


def free_text(llama, tokenizer, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = LLM(llama, tokenizer=tokenizer).generate([[5, 6, 7]], params, use_tqdm=False)[0]
    return out.token_ids, out.text


def test_stop_string_ends_the_request_and_cuts_the_text(llama):
    tokenizer = LetterTokenizer()
    tokens, text = free_text(llama, tokenizer, 40)
    at = next(p for p in range(12, 36) if " " not in text[p:p + 3] and text.index(text[p:p + 3]) == p)
    stop = text[at:at + 3]  # first appears at character `at` (one character per token)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop, "never-there"])
    out = LLM(llama, tokenizer=tokenizer).generate([[5, 6, 7]], params, use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.outputs[0].finish_reason == "stop"
    assert out.token_ids == tokens[:at + 3]  # the token that completed the stop string is the last one
    assert out.text == text[:at]  # the text ends before the stop string


def test_min_tokens_holds_stop_strings_back(llama):
    tokenizer = LetterTokenizer()
    _, text = free_text(llama, tokenizer, 40)
    stop = text[2:4]
    params = SamplingParams(max_tokens=40, min_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop])
    out = LLM(llama, tokenizer=tokenizer).generate([[5, 6, 7]], params, use_tqdm=False)[0]
    assert len(out.token_ids) >= 30


def test_each_step_decodes_a_bounded_tail(llama):
    """A 120-token output checked against a 3-character stop string never decodes more than a short tail per step
    (the old check decoded the whole output every step)."""
    tokenizer = LetterTokenizer()
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True, stop=["zzq"])
    llm = LLM(llama, tokenizer=tokenizer)
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0]
    assert out.finish_reason == "length"
    per_step = tokenizer.decoded_lengths[:-1]  # the last decode is the final text, once
    assert len(per_step) >= 119 and max(per_step) <= 16, max(per_step)


def test_a_stop_string_only_before_min_tokens_does_not_stop(llama):
    """A stop string whose only occurrence ends before `min_tokens` never ends the request (it used to end it at
    exactly `min_tokens`, with the text cut at that early occurrence: empty)."""
    tokenizer = LetterTokenizer()
    tokens, text = free_text(llama, tokenizer, 40)
    at = next(p for p in range(5, 30) if " " not in text[p:p + 3] and text.count(text[p:p + 3]) == 1)
    params = SamplingParams(max_tokens=40, min_tokens=at + 4, temperature=0.0, ignore_eos=True, stop=[text[at:at + 3]])
    out = LLM(llama, tokenizer=tokenizer).generate([[5, 6, 7]], params, use_tqdm=False)[0]
    assert out.finish_reason == "length"
    assert out.token_ids == tokens and out.text == text


def test_a_stop_string_completed_before_and_after_min_tokens_cuts_at_the_later(llama):
    tokenizer = LetterTokenizer()
    tokens, text = free_text(llama, tokenizer, 60)
    found = [(p, text.find(text[p:p + 3], p + 3)) for p in range(0, 12)
             if " " not in text[p:p + 3] and text.index(text[p:p + 3]) == p]
    early, late = next((p, q) for p, q in found if q > 20)
    params = SamplingParams(max_tokens=60, min_tokens=early + 4, temperature=0.0, ignore_eos=True,
                            stop=[text[early:early + 3]])
    out = LLM(llama, tokenizer=tokenizer).generate([[5, 6, 7]], params, use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == tokens[:late + 3] and out.text == text[:late]


def test_a_stop_string_completed_by_the_last_allowed_token_is_a_stop(llama):
    """The max_tokens-th token completing a stop string: finish "stop" and the text cut before it (it used to
    finish "length" with the stop string kept in the text)."""
    tokenizer = LetterTokenizer()
    tokens, text = free_text(llama, tokenizer, 40)
    at = next(p for p in range(12, 36) if " " not in text[p:p + 3] and text.index(text[p:p + 3]) == p)
    params = SamplingParams(max_tokens=at + 3, temperature=0.0, ignore_eos=True, stop=[text[at:at + 3]])
    out = LLM(llama, tokenizer=tokenizer).generate([[5, 6, 7]], params, use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == tokens[:at + 3] and out.text == text[:at]
