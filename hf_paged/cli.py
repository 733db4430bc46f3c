"""`hf-paged`: generate from a prompts file or the command line, run the demo or a benchmark.

    hf-paged generate --model DIR_OR_ID --input prompts.jsonl --output out.jsonl
    hf-paged generate --model tiny --prompt "Hello"
    hf-paged demo [--model DIR]
    hf-paged bench throughput --small --json out.json
    hf-paged serve MODEL [--port 8000 ...]       (transformers serve --continuous-batching, on hf_paged)

Only the standard library (and hf_paged_cli, the front, standard library only) is imported here at start-up: torch
and transformers load when work starts, so `--help` answers at once. hf_paged is imported by absolute name, inside
the functions that run work.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator
from urllib.parse import urlparse

from hf_paged_cli import CliError
from hf_paged_cli.output_file import check_output, lines_done, write_line
from hf_paged_cli.serve_help import serve_help

TINY = "tiny"
BENCHMARKS = {  # name: what it measures (the modules are hf_paged.bench.NAME)
    "throughput": "output tok/s of LLM.generate vs HF generate and generate_batch",
    "prefix": "prefill tokens and time to first token with a shared system prompt, prefix caching on vs off",
    "chunked": "decoders' inter-token latency when a long prompt arrives, chunked prefill on vs off",
    "memory": "sequences held and slots used at a fixed KV budget vs HF's padded cache",
    "swap": "throughput under memory pressure: recompute vs swap vs auto preemption",
    "beam": "beam search on the engine vs HF's",
    "window": "a sliding-window model's long generations: blocks behind the window given back vs kept",
    "serve": "concurrent streaming clients: hf-paged serve vs transformers serve (TTFT, ITL, tok/s)",
    "calls": "per-call cost of generate(cache_implementation='paged') vs HF generate on tiny models",
    "first_call": "a new process's first generate call (start-up check, trials, copies) vs HF's",
    "archs": "many model families at one modest size: paged generate vs HF padded generate",
}
DTYPES = ("auto", "float32", "float16", "bfloat16")


# --- options --------------------------------------------------------------------------------------------------
def add_model_args(p: argparse.ArgumentParser, required: bool) -> None:
    """--model and the engine / loading options shared by generate and demo."""
    p.add_argument("--model", required=required, default=None if required else TINY,
                   help="a local model folder, a Hugging Face Hub id (downloaded or cached), or 'tiny': a built-in "
                        "random-weight model and character tokenizer (no download; its text is noise)")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="weights' dtype (default: auto = the checkpoint's own; float32 for 'tiny')")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda if available, else cpu)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block (default: %(default)s)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV cache blocks to reserve (default: sized from memory)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="most sequences decoded in one step (default: the engine's)")


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens,
                   help="most new tokens per prompt (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this probability mass (default: 1)")
    p.add_argument("--top-k", type=int, default=0, help="keep only the k likeliest tokens; 0 = all (default: 0)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: none)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-paged", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.split("\n")[1:8]))
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,demo,bench,serve}")
    p = sub.add_parser("generate", help="generate for prompts from a file (.txt / .jsonl) or --prompt",
                       description="Generate for every prompt of --input (one JSON line each written to --output, in "
                                   "input order; a rerun skips lines already written) or of --prompt.")
    add_model_args(p, required=True)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", type=Path, help=".txt: one prompt per line; .jsonl: one JSON object per line "
                        "with \"prompt\" (text) or \"messages\" (chat, through the tokenizer's chat template); other "
                        "keys (such as \"id\") are copied to the output line")
    source.add_argument("--prompt", action="append", help="a prompt (repeat for several); prints each prompt and "
                        "its completion")
    p.add_argument("--output", type=Path, help="JSON lines: prompt, text, token_ids, finish_reason, input_line, "
                   "options (the generation options: a rerun must use the same) and the input's other keys "
                   "(required with --input)")
    add_sampling_args(p, max_tokens=64)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=generate)
    p = sub.add_parser("demo", help="continuous batching vs HF generate on the same prompts (no download)",
                       description="Runs the same greedy prompts through hf_paged and through HF generate on one "
                                   "padded batch, compares speed and outputs. Default model: built in, random "
                                   "weights (its text is noise).")
    add_model_args(p, required=False)
    p.add_argument("--requests", type=int, default=48, help="prompts in the batch (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens per prompt (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default: %(default)s)")
    p.set_defaults(func=demo)
    p = sub.add_parser("bench", help="run a benchmark; its options pass through (hf-paged bench NAME --help)",
                       description="Run a benchmark. Results go to its --json (default: a file in the current "
                                   "folder); --small is a quick smoke run, --plot draws a PNG.",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="benchmarks:\n" + "\n".join(f"  {k:<11} {v}" for k, v in BENCHMARKS.items()))
    p.add_argument("name", choices=tuple(BENCHMARKS), metavar="NAME", help="which benchmark (listed below)")
    p.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's own options (--small, --json, --plot...)")
    p.set_defaults(func=bench)
    sub.add_parser("serve", add_help=False, help="an OpenAI-compatible server: transformers serve with continuous "
                   "batching on hf_paged (main() hands it its options; hf-paged serve --help-all lists them)")
    return parser


# --- model loading --------------------------------------------------------------------------------------------
def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hub's host (or the HTTPS proxy in use) accepts a TCP connection within `timeout` seconds."""
    from huggingface_hub import constants

    proxy = next((os.environ[k] for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy") if os.environ.get(k)),
                 None)
    url = urlparse(proxy if proxy and "://" in proxy else f"http://{proxy}" if proxy else constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout):
            return True
    except OSError:
        return False


def locate(model: str) -> dict:
    """from_pretrained keyword arguments for `model` (a folder or a Hub id), or CliError when it cannot be had:
    a missing folder, or an id neither cached nor downloadable (offline or no network) - found in seconds."""
    if Path(model).is_dir():
        return {}
    if model.startswith((".", "/", "~")) or model.count("/") > 1 or os.sep in model.replace("/", ""):
        raise CliError(f"model folder {model} does not exist")
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(model, "config.json"), str):
        return {"local_files_only": True}  # cached: never touch the network
    if constants.HF_HUB_OFFLINE:
        raise CliError(f"model {model} is not a local folder and not in the Hugging Face cache, and HF_HUB_OFFLINE "
                       f"is set: download it first or pass a local folder")
    if not hub_reachable():
        raise CliError(f"model {model} is not a local folder or in the Hugging Face cache, and {constants.ENDPOINT} "
                       f"cannot be reached (no network?): pass a local folder")
    return {}


def load(args, kwargs: dict):
    """(model, tokenizer) for --model (from_pretrained `kwargs` from `locate`), on --device in --dtype."""
    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if args.model == TINY:
        from hf_paged.tiny import tiny_chat_model

        model, tokenizer = tiny_chat_model()
        dtype = torch.float32 if args.dtype == "auto" else getattr(torch, args.dtype)
        return model.to(device=device, dtype=dtype), tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=args.dtype, **kwargs)
    except (OSError, ValueError, KeyError) as e:
        raise CliError(f"cannot load model {args.model}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    return model.to(device).eval(), tokenizer


def engine_options(args) -> dict:
    """The engine options of the command line, checked (EngineConfig.validate): a bad one is a CliError naming it."""
    from hf_paged.config import EngineConfig

    options = {"block_size": args.block_size}
    if args.num_blocks is not None:
        options["num_blocks"] = args.num_blocks
    if args.max_num_seqs is not None:
        options["max_num_seqs"] = args.max_num_seqs
    try:
        EngineConfig(**options).validate()
    except ValueError as e:  # the message starts with the option's name
        name = str(e).split()[0]
        raise CliError(f"--{name.replace('_', '-')}{str(e)[len(name):]}" if name in options else str(e)) from None
    return options


def generation_options(args) -> dict:
    """What --input runs' lines depend on besides the model: stored in each output line ("options")."""
    return {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
            "seed": args.seed}


# --- prompt jobs ----------------------------------------------------------------------------------------------
@dataclass
class Job:
    """One prompt to run: its input line number (1-based), what the engine gets (text or token ids), the prompt
    text written out, and the input's other keys."""
    line: int
    prompt: object
    text: str
    extra: dict


@dataclass
class Bad:
    """An input line that cannot be run, and why."""
    line: int
    reason: str


@dataclass
class Tally:
    written: int = 0
    failed: int = 0


def parse_line(raw: bytes, number: int, jsonl: bool, tokenizer) -> Job | Bad | None:
    """The job of one input line (None for a blank line)."""
    try:
        line = raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as e:
        return Bad(number, f"not UTF-8 ({e.reason} at byte {e.start})")
    if not line.strip():
        return None
    if not jsonl:
        return Job(number, line, line, {})
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        return Bad(number, f"not JSON ({e.msg} at column {e.colno})")
    if not isinstance(record, dict) or not (isinstance(record.get("prompt"), str)
                                            or isinstance(record.get("messages"), list)):
        return Bad(number, 'needs an object with "prompt" (a string) or "messages" (a list of {"role", "content"})')
    extra = {k: v for k, v in record.items() if k != "prompt"}
    if isinstance(record.get("prompt"), str):
        return Job(number, record["prompt"], record["prompt"], extra)
    try:
        text = tokenizer.apply_chat_template(record["messages"], add_generation_prompt=True, tokenize=False)
        ids = tokenizer.apply_chat_template(record["messages"], add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
    except Exception as e:  # noqa: BLE001 - no template, malformed messages...: this line only
        return Bad(number, f"chat template failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return Job(number, list(ids), text, extra)


def prompt_file_jobs(path: Path, done: set[int], tokenizer) -> tuple[Iterator[Job | Bad], int]:
    """(the jobs of the lines not in `done` (already in the output), how many that is at most)."""
    jsonl = path.suffix.lower() in (".jsonl", ".json")
    with open(path, "rb") as f:
        total = sum(1 for number, raw in enumerate(f, 1) if raw.strip() and number not in done)

    def jobs():
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                if number not in done and (job := parse_line(raw, number, jsonl, tokenizer)) is not None:
                    yield job
    return jobs(), total


def print_completion(job: Job, output) -> None:
    completion = output.outputs[0]
    print(f"=== prompt {job.line} ===\n{job.text}\n=== completion ({len(completion.token_ids)} tokens, "
          f"finish_reason={completion.finish_reason}) ===\n{completion.text}\n", flush=True)


def run_jobs(llm, jobs, params, sink, report, total: int, progress: bool, window: int = 256) -> Tally:
    """Run `jobs` with at most `window` in flight; `sink(job, output)` gets each result in input order, `report(line,
    reason)` each job that cannot run. The bar counts prompts done and shows output tok/s."""
    from tqdm.auto import tqdm

    tally, pending, finished, source = Tally(), deque(), {}, iter(jobs)
    bar = tqdm(total=total, unit="prompt", disable=not progress, dynamic_ncols=True)
    start, tokens = time.perf_counter(), 0
    while True:
        while len(pending) < window and (job := next(source, None)) is not None:
            try:
                if isinstance(job, Bad):
                    raise ValueError(job.reason)
                pending.append((job, llm.add_request(job.prompt, params)))
            except ValueError as e:
                report(job.line, str(e))
                tally.failed += 1
                bar.update(1)
        if not pending:
            break
        if not llm.has_unfinished_requests():
            raise RuntimeError(f"the engine lost the request of input line {pending[0][0].line}")
        for output in llm.step():
            tokens += 1
            if output.finished:
                finished[output.request_id] = output
        while pending and pending[0][1] in finished:
            job, request_id = pending.popleft()
            sink(job, finished.pop(request_id))
            tally.written += 1
            bar.update(1)
        bar.set_postfix_str(f"{tokens / max(time.perf_counter() - start, 1e-9):.0f} tok/s", refresh=False)
    bar.close()
    return tally


# --- commands -------------------------------------------------------------------------------------------------
def generate(args) -> int:
    if args.input is not None:
        if args.output is None:
            raise CliError("--input needs --output (a .jsonl file; a rerun skips the lines already in it)")
        if not args.input.is_file():
            raise CliError(f"input file {args.input} does not exist")
        check_output(args.output)
    where = locate(args.model) if args.model != TINY else {}  # before torch loads: a model out of reach fails fast
    options = engine_options(args)
    from hf_paged import LLM, SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed)
        params.validate()
    except ValueError as e:
        raise CliError(str(e)) from None
    done = lines_done(args.output, generation_options(args)) if args.input is not None else set()
    model, tokenizer = load(args, where)
    try:
        llm = LLM(model, tokenizer=tokenizer, **options)
    except ValueError as e:  # the engine's checks of its options against this model and machine
        raise CliError(f"cannot start the engine: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    progress = not args.no_progress
    if args.prompt is not None:
        jobs = [Job(k + 1, text, text, {}) for k, text in enumerate(args.prompt)]
        tally = run_jobs(llm, jobs, params, print_completion, lambda n, why: print(f"prompt {n}: skipped: {why}",
                         file=sys.stderr), total=len(jobs), progress=progress and len(jobs) > 1)
        return 0 if tally.failed == 0 else 1
    jobs, total = prompt_file_jobs(args.input, done, tokenizer)

    def report(line: int, reason: str) -> None:
        from tqdm.auto import tqdm

        tqdm.write(f"{args.input}:{line}: skipped: {reason}", file=sys.stderr)

    stored = generation_options(args)
    with open(args.output, "a", encoding="utf-8") as sink:
        tally = run_jobs(llm, jobs, params, lambda job, out: write_line(sink, job, out, stored), report, total,
                         progress)
    print(f"{args.output}: {tally.written} lines written, {len(done)} already there, {tally.failed} input lines "
          f"skipped", file=sys.stderr)
    return 0 if tally.failed == 0 else 1


def demo(args) -> int:
    from hf_paged.bench.demo import run_demo

    where = locate(args.model) if args.model != TINY else None
    options = engine_options(args)
    model, tokenizer = load(args, where) if where is not None else (None, None)
    return run_demo(model, tokenizer, args, options)


def bench(args) -> int:
    if {"-h", "--help"} & set(args.options):
        from hf_paged_cli.bench_help import bench_help

        return bench_help(args.name, args.options)
    from hf_paged.bench import run

    return run(args.name, args.options)


def serve(options: list[str]) -> int:
    """transformers' `serve` command, its options `options`, continuous batching on hf_paged's engine."""
    import importlib.util

    missing = [name for name in ("fastapi", "uvicorn", "openai", "pydantic") if importlib.util.find_spec(name) is None]
    if missing:
        raise CliError(f"serving needs {', '.join(missing)}: pip install 'hf_paged[serve]'")
    from hf_paged.integrations.serve import main as serve_main

    return serve_main(options)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    serving = argv[:1] == ["serve"]  # its options are transformers serve's, parsed there (--help-all included)
    if serving and serve_help(argv):
        return 0
    args = argparse.Namespace(command="serve", func=lambda _: serve(argv[1:])) if serving else \
        build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CliError as e:
        print(f"hf-paged {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"hf-paged {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
