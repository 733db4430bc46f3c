"""Streaming with hf_paged: `LLM.stream` (a generator) and `LLM.astream` (asyncio, for servers). Tiny random-weight
Llama and character tokenizer, no downloads (the text is noise).

    python examples/streaming.py
"""
import asyncio

from hf_paged import LLM, SamplingParams
from hf_paged.tiny import tiny_chat_model

model, tok = tiny_chat_model()
llm = LLM(model, tok)
params = SamplingParams(max_tokens=12, temperature=0.0)

# 1. One snapshot per prompt that changed, after every engine step: cumulative token ids and text.
for out in llm.stream(["Hello", "Paged attention"], params):
    print(f"[{out.request_id}] {out.text!r}{'  (done)' if out.finished else ''}")


# 2. asyncio: concurrent consumers share one engine; leaving the loop (or cancelling the task) aborts the request
#    and frees its KV blocks at once.
async def client(name: str, prompt: str, stop_after: int | None = None) -> None:
    seen = 0
    async for out in llm.astream(prompt, params):
        seen += 1
        if out.finished or seen == stop_after:
            print(f"{name}: {out.text!r} finished={out.finished}")
            break


async def main() -> None:
    await asyncio.gather(client("a", "one"), client("b", "two", stop_after=3))
    print("blocks free:", llm.stats()["num_blocks_free"], "of", llm.stats()["num_blocks_total"])


asyncio.run(main())
