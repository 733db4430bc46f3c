"""hf_paged in five minutes, on a tiny random-weight Llama (no downloads).

    python examples/quickstart.py
"""
import torch

import hf_paged
from hf_paged.tiny import tiny_model

model = tiny_model("llama")

# 1. Plain HF generate, on the paged engine: same inputs, same output tensor.
ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
mask = (ids != 0).long()
paged = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, cache_implementation="paged")
plain = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
print("generate:", paged.tolist(), "identical to HF:", torch.equal(paged, plain))

# 2. The offline batch API with vLLM-style sampling parameters.
llm = hf_paged.LLM(model, block_size=16, max_num_seqs=64)
outs = llm.generate([[5, 6, 7], [8, 9]], hf_paged.SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
for out in outs:
    print(out.prompt_token_ids, "->", out.token_ids, out.finish_reason)

# 3. Streaming-style control: add requests, step, abort.
rid = llm.add_request([3, 4, 5], hf_paged.SamplingParams(max_tokens=100, temperature=0.8, seed=0))
for _ in range(4):
    for out in llm.step():
        print("step:", out.request_id, out.token_ids)
llm.abort(rid)
print(llm.stats())
