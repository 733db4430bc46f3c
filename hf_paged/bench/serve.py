"""Serving load test: N concurrent streaming clients (the `openai` client) against `hf-paged serve` and against
`transformers serve --continuous-batching` (hf_paged not imported: a process of its own) on the same model.

    hf-paged bench serve                      # 32 clients, 48 new tokens each, the model below; about 2-4 minutes
    hf-paged bench serve --clients 16 --max-tokens 32
    hf-paged bench serve --small              # quick smoke run (tiny model, 8 clients, 8 tokens)

Needs the serve extra (pip install 'hf_paged[serve]'). Design goal: hf_paged's server >= 2x transformers' output
tok/s with a p99 inter-token latency no worse.

Model: a random-weight Llama (hidden 384, 6 layers, 6 heads, 2 KV heads, intermediate 768, vocab 512, fp32) over
hf_paged's character tokenizer (`hf_paged.tiny.tiny_tokenizer`: one token per character), saved to a temporary folder
(no download); the output head's rows of the special tokens are zeroed so that no answer ends early and each
character streamed is one token. Prompts: random printable ASCII, 64-160 characters (stdlib RNG, seed 0), the same
for both servers. Each server runs on 127.0.0.1 with the same `--cb-num-blocks` (KV capacity: num_blocks x 256
tokens, transformers' page size; hf_paged converts it to its own 16-token blocks), HF_HUB_OFFLINE=1. Per server:
start, wait for /v1/models, a warm-up (every client once with 4 new tokens, twice), then the measured round: all
clients at once, each one `completions.create(stream=True, max_tokens=M, temperature=0)` with the end-of-sequence
token disabled (`generation_config: {"eos_token_id": -1}`) so every answer has M tokens. Per request: time to first
token (TTFT: from the request's send to its first streamed text), inter-token latency (ITL: the gaps between its
streamed chunks, as a client sees them: one gap per chunk, as vLLM's benchmark counts them), and per-token time
(TPOT: (latency - TTFT) / (tokens - 1)). Output tok/s: all the tokens streamed / (first send -> last token). The
server then stops (SIGTERM) before the other starts: they never share the machine's cores. Which engine served is
checked: `GET /hf_paged/stats` answers hf_paged's engine stats on hf-paged serve, 404 on transformers'.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from .common import format_table, machine_info, machine_load, percentile, write_json

SYSTEMS = ("hf_paged", "transformers")
FULL = dict(model=dict(vocab_size=512, hidden=384, layers=6, heads=6, kv_heads=2, max_len=2048), clients=32,
            max_tokens=48, num_blocks=64)
SMALL = dict(model=dict(vocab_size=128, hidden=64, layers=2, heads=4, kv_heads=2, max_len=1024), clients=8,
             max_tokens=8, num_blocks=16)
PROMPT_CHARS = (64, 160)
NO_EOS = {"generation_config": json.dumps({"eos_token_id": -1})}
TARGET = {"throughput_ratio": 2.0, "itl_p99_ratio_max": 1.0}
ROOT = Path(__file__).resolve().parents[2]


def save_model(folder: Path, sizes: dict) -> None:
    """The random-weight model and its character tokenizer, saved (in a subprocess: this one stays torch-free)."""
    code = ("import json, sys, torch; from hf_paged.tiny import tiny_model, tiny_tokenizer\n"
            "sizes = json.loads(sys.argv[2]); model = tiny_model('llama', **sizes)\n"
            "with torch.no_grad(): model.get_output_embeddings().weight[:4] = 0.0\n"
            "model.save_pretrained(sys.argv[1]); tiny_tokenizer(sizes['vocab_size']).save_pretrained(sys.argv[1])")
    subprocess.run([sys.executable, "-c", code, str(folder), json.dumps(sizes)], check=True, env=environment(),
                   capture_output=True)


def environment() -> dict:
    root = str(ROOT)
    return dict(os.environ, HF_HUB_OFFLINE="1",
                PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))


def make_prompts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    letters = [chr(c) for c in range(32, 127)]
    return ["".join(rng.choice(letters) for _ in range(rng.randint(*PROMPT_CHARS))) for _ in range(count)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(system: str, folder: Path, port: int, num_blocks: int) -> list[str]:
    options = [str(folder), "--host", "127.0.0.1", "--port", str(port), "--cb-num-blocks", str(num_blocks),
               "--log-level", "warning"]
    if system == "hf_paged":
        return [sys.executable, "-c", "import sys; from hf_paged_cli import main; sys.exit(main(sys.argv[1:]))",
                "serve", *options]
    return [sys.executable, "-c", "import sys; from transformers.cli.transformers import app; app()",
            "serve", "--continuous-batching", *options]


def get(url: str, timeout: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def start(system: str, folder: Path, num_blocks: int, log: Path, timeout: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    with open(log, "wb") as sink:
        proc = subprocess.Popen(server_command(system, folder, port, num_blocks), stdout=sink,
                                stderr=subprocess.STDOUT, env=environment())
    base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
    while True:
        try:
            get(base + "/v1/models")
            return proc, base
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop(proc)
                raise RuntimeError(f"{system} server did not start:\n{log.read_text()[-3000:]}") from None
            time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def engine_of(base: str, model: str) -> str:
    """Which engine serves `model`: hf_paged (its stats route answers) or transformers' own (404)."""
    try:
        stats = get(base + "/hf_paged/stats")
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return "transformers"
        raise
    return "hf_paged" if stats.get(model, {}).get("hf_paged") else "transformers (through hf-paged serve)"


async def one_request(client, model: str, prompt: str, max_tokens: int) -> dict:
    sent = time.perf_counter()
    times, sizes = [], []
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, extra_body=NO_EOS)
    async for chunk in stream:
        text = chunk.choices[0].text if chunk.choices else ""
        if text:
            times.append(time.perf_counter())
            sizes.append(len(text))
    return {"sent": sent, "times": times, "tokens": sum(sizes)}


async def round_of(base: str, model: str, prompts: list[str], max_tokens: int) -> list[dict]:
    import openai

    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600) as client:
        return await asyncio.gather(*(one_request(client, model, p, max_tokens) for p in prompts))


def summarize(requests: list[dict], max_tokens: int) -> dict:
    ttft = [r["times"][0] - r["sent"] for r in requests if r["times"]]
    itl = [b - a for r in requests for a, b in zip(r["times"], r["times"][1:])]
    tpot = [(r["times"][-1] - r["times"][0]) / (r["tokens"] - 1) for r in requests if r["tokens"] > 1]
    tokens = sum(r["tokens"] for r in requests)
    wall = max(t for r in requests for t in r["times"]) - min(r["sent"] for r in requests)
    chunks = sum(len(r["times"]) for r in requests)
    ms = lambda values, q: None if not values else round(1000 * percentile(values, q), 2)  # noqa: E731
    return {"requests": len(requests), "tokens": tokens, "complete": all(r["tokens"] == max_tokens for r in requests),
            "wall_s": round(wall, 3), "output_tok_s": round(tokens / wall, 1),
            "ttft_p50_ms": ms(ttft, 50), "ttft_p99_ms": ms(ttft, 99), "itl_p50_ms": ms(itl, 50),
            "itl_p99_ms": ms(itl, 99), "tpot_p50_ms": ms(tpot, 50), "tpot_p99_ms": ms(tpot, 99),
            "tokens_per_chunk": round(tokens / max(chunks, 1), 2)}


def run_system(system: str, folder: Path, setup: dict, prompts: list[str], logs: Path, timeout: float) -> dict:
    print(f"[{system}] starting the server...", flush=True)
    began = time.perf_counter()
    proc, base = start(system, folder, setup["num_blocks"], logs / f"{system}.log", timeout)
    try:
        started = time.perf_counter() - began
        model = str(folder)
        engine = engine_of(base, model)
        for _ in range(2):
            asyncio.run(round_of(base, model, prompts, 4))
        print(f"[{system}] up in {started:.1f} s ({engine}); measuring {len(prompts)} clients x "
              f"{setup['max_tokens']} tokens...", flush=True)
        requests = asyncio.run(round_of(base, model, prompts, setup["max_tokens"]))
        result = {"engine": engine, "startup_s": round(started, 1), **summarize(requests, setup["max_tokens"])}
    finally:
        stop(proc)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-paged bench serve", description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=None, help="concurrent clients (default 32; small 8)")
    parser.add_argument("--max-tokens", type=int, default=None, help="new tokens per request (default 48; small 8)")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="--cb-num-blocks of both servers, in 256-token blocks (default 64; small 16)")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--json", default="hf-paged-bench-serve.json",
                        help="where to write the results (default: %(default)s in the current folder)")
    parser.add_argument("--small", action="store_true", help="tiny model and sizes, for a quick smoke test")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a server may take to start")
    args = parser.parse_args(argv)
    try:
        import openai  # noqa: F401
    except ImportError:
        print("hf-paged bench serve needs the serve extra: pip install 'hf_paged[serve]'", file=sys.stderr)
        return 2
    setup = dict(SMALL if args.small else FULL)
    for key in ("clients", "max_tokens", "num_blocks"):
        if getattr(args, key) is not None:
            setup[key] = getattr(args, key)
    prompts = make_prompts(setup["clients"])
    results: dict = {"benchmark": "serve", "setup": {**setup, "prompt_chars": PROMPT_CHARS}, "target": TARGET,
                     "machine": machine_info(), "load_before": machine_load(), "systems": {}}
    with tempfile.TemporaryDirectory(prefix="hf_paged_bench_serve_") as tmp:
        folder, logs = Path(tmp) / "model", Path(tmp)
        save_model(folder, setup["model"])
        for system in args.systems:
            results["systems"][system] = run_system(system, folder, setup, prompts, logs, args.timeout)
    results["load_after"] = machine_load()
    ours, theirs = (results["systems"].get(s) for s in SYSTEMS)
    if ours and theirs:
        results["throughput_ratio"] = round(ours["output_tok_s"] / theirs["output_tok_s"], 2)
        results["itl_p99_ratio"] = round(ours["itl_p99_ms"] / theirs["itl_p99_ms"], 2)
        results["goal_met"] = (results["throughput_ratio"] >= TARGET["throughput_ratio"]
                               and results["itl_p99_ratio"] <= TARGET["itl_p99_ratio_max"])
    keys = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
            "tokens_per_chunk", "startup_s")
    print(format_table(["server", *keys], [[s, *(r[k] for k in keys)] for s, r in results["systems"].items()]))
    if "throughput_ratio" in results:
        print(f"hf_paged / transformers: {results['throughput_ratio']}x output tok/s, p99 ITL ratio "
              f"{results['itl_p99_ratio']} (goal: >= {TARGET['throughput_ratio']}x and <= 1): "
              f"{'met' if results['goal_met'] else 'NOT met'}")
    print(f"results written to {write_json(args.json, results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
