"""`hf-paged serve`: transformers' OpenAI-compatible server with continuous batching on hf_paged's engine, through the
real `openai` client on loopback. One server (`hf-paged serve FOLDER`, in a subprocess; transformers runs the model in
a process of its own) on a tiny random-weight model saved to a temporary folder, no download: /v1/models lists it and
hf_paged's engine serves it; completions and chat completions, streamed (SSE) or not, are the model's own greedy
`generate` for the same prompt ids (chat: the tokenizer's chat template, as the server applies it); 32 concurrent
clients each get their own answer; a client leaving mid-stream has its request cancelled and its KV blocks freed at
once (seen through the engine's stats, `GET /hf_paged/stats`)."""
from __future__ import annotations

import asyncio
import json
import os
import pickle
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parent.parent
NEW_TOKENS = 16
TIMEOUT = 30  # seconds a request may take: a broken server fails the test rather than hangs it
NO_EOS = {"generation_config": json.dumps({"eos_token_id": -1})}  # a request that runs to max_tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Llama (clear greedy margins) and the character tokenizer with its chat template, saved."""
    import torch

    from hf_paged.tiny import tiny_model, tiny_tokenizer

    model = tiny_model("llama", vocab_size=128, hidden=64, layers=2, heads=4, kv_heads=2, max_len=2048)
    with torch.no_grad():  # pad, bos and unk (they decode to nothing) never win a greedy pick
        model.get_output_embeddings().weight[[0, 1, 3]] = 0.0
    path = tmp_path_factory.mktemp("serve_model")
    model.save_pretrained(path)
    tiny_tokenizer(128).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    """(base URL, model name) of `hf-paged serve FOLDER` on a free loopback port; stopped at the end."""
    port, log = free_port(), tmp_path_factory.mktemp("serve_log") / "server.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    command = [sys.executable, "-c", "import sys; from hf_paged_cli import main; sys.exit(main(sys.argv[1:]))",
               "serve", str(folder), "--host", "127.0.0.1", "--port", str(port), "--cb-block-size", "16",
               "--cb-num-blocks", "256", "--log-level", "warning"]
    with open(log, "wb") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                get_json(base + "/v1/models")
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the server did not start (exit {proc.poll()}):\n{log.read_text()[-3000:]}")
                time.sleep(0.25)
        yield base, str(folder)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def reference(folder):
    """`ids -> text`: the model's own greedy `generate` (transformers', in this process) for prompt ids `ids`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)

    def greedy(ids: list[int], max_new_tokens: int = NEW_TOKENS) -> str:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 do_sample=False, max_new_tokens=max_new_tokens)
        return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)

    greedy.tokenizer = tokenizer
    return greedy


def options(base: str) -> dict:
    """The openai client's: the server's /v1, no retries, a timeout."""
    return {"base_url": base + "/v1", "api_key": "none", "max_retries": 0, "timeout": TIMEOUT}


def stats(base: str, name: str) -> dict:
    return get_json(base + "/hf_paged/stats")[name]


def test_models_lists_the_model_and_hf_paged_serves_it(server):
    base, name = server
    client = openai.OpenAI(**options(base))
    assert [m.id for m in client.models.list()] == [name]
    engine = stats(base, name)
    assert engine["hf_paged"] is True, engine  # hf_paged's manager, not transformers' own
    assert engine["num_blocks_total"] == 256 and engine["block_size"] == 16


def test_completions_are_greedy_generate(server, reference):
    base, name = server
    client = openai.OpenAI(**options(base))
    prompt = "The quick brown fox"
    expected = reference(reference.tokenizer(prompt)["input_ids"])
    assert expected
    answer = client.completions.create(model=name, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
    assert answer.choices[0].text == expected
    chunks = list(client.completions.create(model=name, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_chat_completions_are_greedy_generate_on_the_chat_template(server, reference):
    base, name = server
    client = openai.OpenAI(**options(base))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, who are you?"}]
    ids = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"]
    expected = reference(list(ids))
    answer = client.chat.completions.create(model=name, messages=messages, max_tokens=NEW_TOKENS, temperature=0)
    assert answer.choices[0].message.content == expected
    assert answer.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model=name, messages=messages, max_tokens=NEW_TOKENS,
                                                 temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected


def test_32_concurrent_clients_each_get_their_own_answer(server, reference):
    base, name = server
    prompts = [f"Request {k}: " + "abcdefghijklmnopqrstuvwxyz"[k % 26:] * (1 + k % 3) for k in range(32)]
    expected = [reference(reference.tokenizer(p)["input_ids"]) for p in prompts]
    before = stats(base, name)

    async def one(client, k: int) -> str:
        if k % 2:  # half stream
            stream = await client.completions.create(model=name, prompt=prompts[k], max_tokens=NEW_TOKENS,
                                                     temperature=0, stream=True)
            return "".join([c.choices[0].text async for c in stream if c.choices])
        answer = await client.completions.create(model=name, prompt=prompts[k], max_tokens=NEW_TOKENS, temperature=0)
        return answer.choices[0].text

    async def everyone() -> list[str]:
        async with openai.AsyncOpenAI(**options(base)) as client:
            return await asyncio.gather(*(one(client, k) for k in range(32)))

    got = asyncio.run(everyone())
    assert [k for k in range(32) if got[k] != expected[k]] == []
    after = stats(base, name)
    assert after["num_finished"] - before["num_finished"] == 32
    assert after["num_running"] == 0 and after["num_blocks_free"] == after["num_blocks_total"]


def test_a_client_leaving_mid_stream_cancels_its_request_and_frees_its_blocks(server):
    base, name = server
    client = openai.OpenAI(**options(base))
    before = stats(base, name)
    assert before["num_running"] == 0 and before["num_blocks_free"] == before["num_blocks_total"]
    long = 2000  # tokens: seconds of decoding, more than the test waits
    stream = client.completions.create(model=name, prompt="Tell me everything.", max_tokens=long, temperature=0,
                                       stream=True, extra_body=NO_EOS)
    received = 0
    for chunk in stream:
        received += len(chunk.choices[0].text) if chunk.choices else 0
        if received >= 8:
            break
    running = stats(base, name)
    assert running["num_running"] == 1 and running["num_blocks_free"] < running["num_blocks_total"]
    stream.close()  # the client leaves
    left, deadline = time.monotonic(), time.monotonic() + 5.0
    while True:
        now = stats(base, name)
        if now["num_running"] == now["num_waiting"] == 0 and now["num_blocks_free"] == now["num_blocks_total"]:
            break
        assert time.monotonic() < deadline, f"still held {time.monotonic() - left:.1f} s after the client left: {now}"
        time.sleep(0.05)
    assert now["num_generated_tokens"] - before["num_generated_tokens"] < long  # stopped, not run to its end
    assert now["num_finished"] == before["num_finished"]  # cancelled: it never finished


def test_the_built_in_model_goes_by_tiny_and_the_loader_reaches_the_model_process(tmp_path):
    """`hf-paged serve tiny`: the loader maps the name to the folder it was saved to, and travels (pickled, as to the
    model's process) as hf_paged's class, whose import there enables hf_paged."""
    from transformers.cli.serving.model_manager import ModelLoader

    from hf_paged.integrations.serve import PagedModelLoader, _save_tiny

    aliases = _save_tiny(str(tmp_path))
    assert set(aliases) == {"tiny", "tiny@main"}
    loader = pickle.loads(pickle.dumps(PagedModelLoader.of(ModelLoader(device="cpu"), aliases)))
    assert type(loader) is PagedModelLoader and loader.aliases == aliases and loader.device == "cpu"
    config, _ = loader.load_config("tiny@main")
    assert config.model_type == "llama" and loader.load_processor("tiny").chat_template
