"""A transformers text-generation pipeline served as ONE hf_paged engine run (tiny random-weight Llama, no downloads:
the texts are noise, the point is that they match HF's and arrive faster).

    python examples/pipeline.py
"""
import time

from transformers import pipeline

import hf_paged
from hf_paged.tiny import tiny_model, tiny_tokenizer

model = tiny_model("llama", hidden=256, layers=4, vocab_size=256)
tok = tiny_tokenizer(256)
prompts = [f"Prompt number {k}: " + "abc" * k for k in range(24)]

# "paged" at construction: every call runs the whole input list through one engine, results in input order.
pipe = pipeline("text-generation", model=model, tokenizer=tok, batch_size=4, cache_implementation="paged")
start = time.perf_counter()
paged = pipe(prompts, max_new_tokens=16, do_sample=False, return_full_text=False)
paged_s = time.perf_counter() - start

hf_paged.disable()  # transformers exactly as without hf_paged, for comparison
plain = pipeline("text-generation", model=model, tokenizer=tok, batch_size=4)
start = time.perf_counter()
ref = plain(prompts, max_new_tokens=16, do_sample=False, return_full_text=False)
hf_s = time.perf_counter() - start
hf_paged.enable()
print(f"identical to HF's pipeline: {paged == ref}; HF {hf_s:.2f} s, paged {paged_s:.2f} s")

# Per call, chat messages (the tokenizer's chat template), a generator read as the engine needs work:
chats = [[{"role": "user", "content": f"Say {k}"}] for k in range(3)]
for out in pipe(chats, max_new_tokens=8, do_sample=False):
    print(out[0]["generated_text"][-1])
for out in pipeline("text-generation", model=model, tokenizer=tok)(
        (p for p in prompts[:3]), max_new_tokens=8, do_sample=False, cache_implementation="paged"):
    print(repr(out[0]["generated_text"]))
