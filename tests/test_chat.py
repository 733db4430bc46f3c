"""`LLM.chat` (hf_paged/chat.py, vLLM's spelling): conversations rendered with the chat template, one output each, HF's
tokens; what is not a conversation is refused naming it; `generate` given a conversation points at `chat`."""
import pytest
import torch

import hf_paged
from hf_paged.tiny import tiny_chat_model

GREEDY = hf_paged.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
CHATS = [[{"role": "user", "content": "hello"}],
         [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is a page?"}]]


@pytest.fixture(scope="module")
def chat_llm():
    model, tok = tiny_chat_model()
    return model, tok, hf_paged.LLM(model, tok, num_blocks=64)


def hf_reply(model, tok, conversation):
    ids = tok(tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist(), ids[0].tolist()


def test_chat_gives_hfs_reply_per_conversation(chat_llm, one_torch_thread):
    model, tok, llm = chat_llm
    outs = llm.chat(CHATS, GREEDY, use_tqdm=False)
    assert len(outs) == 2
    for conversation, out in zip(CHATS, outs):
        reply, prompt = hf_reply(model, tok, conversation)
        assert out.prompt_token_ids == prompt and out.outputs[0].token_ids == reply
    one = llm.chat(CHATS[1], GREEDY, use_tqdm=False)  # one conversation: one output
    assert len(one) == 1 and one[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_what_is_not_a_conversation_is_refused(chat_llm):
    model, tok, llm = chat_llm
    with pytest.raises(ValueError, match="request 1: a conversation"):
        llm.chat([CHATS[0], "plain text"], GREEDY)
    with pytest.raises(ValueError, match="use LLM.chat"):
        llm.generate([CHATS[0]], GREEDY)
    with pytest.raises(ValueError, match="cannot both"):
        llm.chat(CHATS[0], GREEDY, continue_final_message=True)
    bare = hf_paged.LLM(model, num_blocks=16)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        bare.chat(CHATS[0], GREEDY)
