"""transformers' own continuous-batching tests, run twice beside the project: without and with hf_paged.

    python benchmarks/transformers_cb_tests.py --transformers-src DIR [-k EXPR] [--timeout 180] [--cpu-memory 4]
        [--out DIR]

DIR is a source checkout of transformers' repository at a commit near the installed transformers: its
`tests/generation/test_continuous_batching.py` runs as it is (it needs pytest and `parameterized`). Nothing is
fetched: every Hub model id the file names is served by a tiny random-weight model of the same family (a config, fixed
seeds, saved once under --out so that both runs load the same weights) with a character-level tokenizer.

Each run is one pytest process that loads this file as a plugin (`-p`). The plugin imports hf_paged in the second run
only; lifts `require_torch_accelerator` and sets RUN_SLOW=1, so that the generation tests run on the CPU (those needing
CUDA graphs or several devices skip themselves, those loading flash attention fail in both runs); replaces any name the
file imports that the installed transformers lacks (a file a little newer than the library) by a stub that raises, so
only the tests using it fail, in both runs (the names are printed); fails a test that runs past --timeout seconds; and
records, per test, the tokens of every `generate_batch` and of every finished request a manager returns (`get_result`,
`request_id_iter`).

Prints collected / passed / failed / skipped for each run, the tests whose outcome differs (with the first line of
the failure), and how many of the tests that recorded outputs give identical tokens in both runs. On a CPU,
transformers' own manager sizes its cache from the machine's memory (a run was once killed for memory at 13.5 GB): the
plugin makes it see at most --cpu-memory GiB.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import signal
import subprocess
import sys
import tempfile
import types
import xml.etree.ElementTree as ET
from pathlib import Path

TEST_FILE = "tests/generation/test_continuous_batching.py"
RUN = "HF_PAGED_CB_RUN"  # "without" / "with" in the pytest process (this file is its plugin); unset in the driver
# Hub id the file names -> tiny family served in its place (SmolLM: only its config is read)
MODELS = {"TinyLlama/TinyLlama-1.1B-Chat-v1.0": "llama", "Qwen/Qwen2.5-0.5B-Instruct": "qwen2",
          "google/gemma-2-2b-it": "gemma2", "google/gemma-3-1b-it": "gemma3_text",
          "HuggingFaceTB/SmolLM-1.7B": "llama"}
# a short template: the block-sharing test wants its prompt between 33 and 64 tokens
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}>{% endif %}")


def local_dir(out: str | Path, model_id: str) -> Path:
    return Path(out, "models", model_id.replace("/", "--"))


def build_models(out: Path) -> None:
    """Save each tiny stand-in once: a random-weight model (seed 0, vocabulary 128) and its tokenizer."""
    import torch

    from hf_paged.tiny import tiny_mixed, tiny_model, tiny_tokenizer

    for model_id, family in MODELS.items():
        where = local_dir(out, model_id)
        if where.is_dir():
            continue
        if family == "gemma3_text":  # five sliding-window layers (16 tokens) to one full, as gemma 3
            model = tiny_mixed(family, window=16, vocab_size=128, max_len=2048, sharpen=2.0)
        else:
            model = tiny_model(family, seed=0, vocab_size=128, max_len=2048, sharpen=2.0)
        with torch.no_grad():  # pad, bos and unk never win a greedy pick (as hf_paged.tiny.tiny_chat_model)
            model.get_output_embeddings().weight[[0, 1, 3]] = 0.0
        tokenizer = tiny_tokenizer(128)
        tokenizer.chat_template = CHAT_TEMPLATE
        model.save_pretrained(where)
        tokenizer.save_pretrained(where)


# ---- the plugin (inside each pytest process) ---------------------------------------------------------------------
def _stub_missing_imports(src: Path, test_file: Path) -> list[str]:
    """Give every module the file imports from the names it lacks, as stubs that raise when called (a module that
    fails to import: an empty stand-in)."""
    import importlib

    missing = []
    for node in ast.walk(ast.parse(test_file.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.ImportFrom):
            continue
        parts = test_file.parent.relative_to(src).parts  # a relative import: from the file's package under DIR
        name = ".".join(parts[: len(parts) - node.level + 1] + ((node.module,) if node.module else ())) \
            if node.level else node.module
        if not name.startswith(("transformers", "tests")):
            continue
        try:
            module = importlib.import_module(name)
        except ImportError as error:  # e.g. a test helper importing what this checkout or library lacks
            module = sys.modules[name] = types.ModuleType(name)
            missing.append(f"{name} ({error})")
        for alias in node.names:
            if not hasattr(module, alias.name):
                def stub(*args, _name=f"{name}.{alias.name}", **kwargs):
                    raise NotImplementedError(f"{_name} is not in the installed transformers")
                setattr(module, alias.name, stub)
                missing.append(f"{name}.{alias.name}")
    return missing


def _install_plugin():
    src, out = Path(os.environ["HF_PAGED_CB_SRC"]), Path(os.environ["HF_PAGED_CB_OUT"])
    sys.path.insert(0, str(src))
    import transformers.testing_utils as testing_utils
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    testing_utils.require_torch_accelerator = lambda test: test
    import transformers.generation.continuous_batching.cache as cb_cache

    breakdown, cap = cb_cache.get_device_and_memory_breakdown, int(os.environ["HF_PAGED_CB_CPU_GIB"]) << 30

    def capped_breakdown():  # on a CPU transformers' manager sizes its cache from the machine's memory
        device, total, reserved, allocated = breakdown()
        return (device, min(total, cap), reserved, allocated) if device.type == "cpu" else (device, total, reserved,
                                                                                           allocated)
    cb_cache.get_device_and_memory_breakdown = capped_breakdown
    if os.environ[RUN] == "with":
        import hf_paged  # noqa: F401 - enables it
    from transformers.generation.continuous_batching.continuous_api import ContinuousMixin

    for cls in (AutoConfig, AutoModelForCausalLM, AutoTokenizer):  # Hub ids -> the tiny stand-ins
        def from_pretrained(klass, name, *args, _original=cls.from_pretrained.__func__, **kwargs):
            if isinstance(name, str) and name in MODELS:
                name = str(local_dir(out, name))
            return _original(klass, name, *args, **kwargs)
        cls.from_pretrained = classmethod(from_pretrained)

    records: dict[str, list] = {}
    current = {"test": None}

    def record(kind, outputs):
        if kind == "result" and current.get("in_batch"):  # generate_batch's own manager: its outputs are recorded
            return
        pairs = sorted([list(o.prompt_ids), list(o.generated_tokens)] for o in outputs)  # order-free
        records.setdefault(current["test"], []).append([kind, pairs])

    generate_batch, init = ContinuousMixin.generate_batch, ContinuousMixin.init_continuous_batching

    def recorded_generate_batch(self, *args, **kwargs):
        current["in_batch"] = True
        try:
            results = generate_batch(self, *args, **kwargs)
        finally:
            current["in_batch"] = False
        record("generate_batch", results.values())
        return results

    def recorded_init(self, *args, **kwargs):
        manager = init(self, *args, **kwargs)
        get_result, id_iter = manager.get_result, manager.request_id_iter

        def recorded_get_result(*a, **k):
            output = get_result(*a, **k)
            if output is not None and output.is_finished():
                record("result", [output])
            return output

        def recorded_id_iter(*a, **k):
            for output in id_iter(*a, **k):
                if output.is_finished():
                    record("result", [output])
                yield output
        manager.get_result, manager.request_id_iter = recorded_get_result, recorded_id_iter
        return manager

    ContinuousMixin.generate_batch, ContinuousMixin.init_continuous_batching = recorded_generate_batch, recorded_init
    missing = _stub_missing_imports(src, src / os.environ["HF_PAGED_CB_FILE"])
    timeout = int(os.environ["HF_PAGED_CB_TIMEOUT"])
    import pytest

    class Plugin:
        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_call(self, item):
            current["test"] = item.nodeid

            def expire(signum, frame):
                raise TimeoutError(f"test ran past {timeout} s")
            previous = signal.signal(signal.SIGALRM, expire)
            signal.alarm(timeout)
            try:
                yield
            finally:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, previous)

        def pytest_sessionfinish(self, session):
            Path(out, f"{os.environ[RUN]}.json").write_text(json.dumps({"records": records, "stubbed": missing}))

    return Plugin()


if os.environ.get(RUN):  # loaded by pytest (-p transformers_cb_tests)
    _PLUGIN = _install_plugin()

    def pytest_configure(config):
        config.pluginmanager.register(_PLUGIN, "hf_paged_cb_recorder")


# ---- the driver -------------------------------------------------------------------------------------------------
def outcomes(xml_path: Path) -> dict[str, tuple[str, str]]:
    """test id -> (passed / failed / skipped, first line of the message)."""
    result = {}
    if not xml_path.exists():
        return result
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        status, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                status = "skipped" if child.tag == "skipped" else "failed"
                text = (child.get("message") or child.text or "").strip()
                message = text.splitlines()[0][:160] if text else ""
        result[name] = (status, message)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transformers-src", required=True, help="a source checkout of transformers' repository")
    parser.add_argument("-k", default=None, help="pytest -k expression")
    parser.add_argument("--timeout", type=int, default=180, help="seconds a test may run")
    parser.add_argument("--cpu-memory", type=int, default=4, help="GiB transformers' manager sizes its cache from "
                        "on a CPU (it takes a share of the machine's memory otherwise)")
    parser.add_argument("--out", default=None, help="where the models, reports and recorded outputs go")
    args = parser.parse_args()
    src = Path(args.transformers_src).resolve()
    if not (src / TEST_FILE).is_file():
        sys.exit(f"{src / TEST_FILE} not found: --transformers-src must be a source checkout of transformers' "
                 "repository (the PyPI packages carry no tests/generation)")
    out = Path(args.out or tempfile.mkdtemp(prefix="transformers_cb_tests_")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    build_models(out)
    here = str(Path(__file__).resolve().parent)
    env = dict(os.environ, RUN_SLOW="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_PAGED_CB_SRC=str(src),
               HF_PAGED_CB_OUT=str(out), HF_PAGED_CB_FILE=TEST_FILE, HF_PAGED_CB_TIMEOUT=str(args.timeout),
               HF_PAGED_CB_CPU_GIB=str(args.cpu_memory),
               PYTHONPATH=os.pathsep.join([here, str(src), os.environ.get("PYTHONPATH", "")]))
    results = {}
    for run in ("without", "with"):
        command = [sys.executable, "-m", "pytest", str(src / TEST_FILE), "-p", Path(__file__).stem, "-q",
                   "-p", "no:cacheprovider", "--rootdir", str(src), "-o", "addopts=",
                   "--junitxml", str(out / f"{run}.xml")] + (["-k", args.k] if args.k else [])
        try:
            subprocess.run(command, env={**env, RUN: run}, cwd=src, timeout=args.timeout * 40,
                           stdout=open(out / f"{run}.log", "w"), stderr=subprocess.STDOUT)
        except subprocess.TimeoutExpired:
            print(f"{run} hf_paged: the pytest process ran out of time; counting what it reported")
        if not (out / f"{run}.xml").exists():
            print(f"{run} hf_paged: pytest wrote no report; the end of {out / f'{run}.log'}:")
            print("".join(open(out / f"{run}.log").readlines()[-15:]))
        recorded = json.loads((out / f"{run}.json").read_text()) if (out / f"{run}.json").exists() else {}
        results[run] = (outcomes(out / f"{run}.xml"), recorded.get("records", {}), recorded.get("stubbed", []))
    print(f"transformers tests: {src / TEST_FILE}; reports, logs and outputs under {out}")
    for run, (found, _, stubbed) in results.items():
        counts = {s: sum(v[0] == s for v in found.values()) for s in ("passed", "failed", "skipped")}
        print(f"{run:>7} hf_paged: {len(found)} collected, {counts['passed']} passed, {counts['failed']} failed, "
              f"{counts['skipped']} skipped" + (f"; stubbed (missing here): {stubbed}" if stubbed else ""))
    (plain, plain_rec, _), (paged, paged_rec, _) = results["without"], results["with"]
    for name in sorted(set(plain) | set(paged)):
        a, b = plain.get(name, ("absent", "")), paged.get(name, ("absent", ""))
        if a[0] != b[0]:
            print(f"  outcome differs: {name}: without {a[0]}, with {b[0]}: {b[1] or a[1]}")
    def canon(records):  # the distinct outputs of a test, whatever their order or repetition (a manager's
        return sorted({json.dumps([kind, pair]) for kind, pairs in records for pair in pairs})  # iterator may re-read)

    both = sorted(set(plain_rec) & set(paged_rec))
    same = [t for t in both if canon(plain_rec[t]) == canon(paged_rec[t])]
    print(f"outputs recorded in both runs by {len(both)} tests: identical in {len(same)}")
    for t in sorted(set(both) - set(same)):
        print(f"  outputs differ: {t}")
    for t in sorted(set(plain_rec) ^ set(paged_rec)):
        print(f"  outputs recorded in one run only: {t} ({'without' if t in plain_rec else 'with'} hf_paged)")


if __name__ == "__main__" and not os.environ.get(RUN):
    main()
