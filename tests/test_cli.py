"""`hf-paged`: the demo runs offline and matches HF; generate reads .txt / .jsonl prompt files, writes JSON lines in
input order, resumes, skips bad lines with their numbers; --help and an unreachable model answer at once."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hf_paged.cli import main

ROOT = Path(__file__).resolve().parent.parent
# loads hf_paged/cli.py without importing the hf_paged package (whose __init__ loads torch and transformers), as a
# console entry point outside the package does; prints which heavy modules got imported
FRONT = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('cli_front', sys.argv.pop(1)); "
         "m = importlib.util.module_from_spec(spec); sys.modules['cli_front'] = m; spec.loader.exec_module(m)\n"
         "try:\n    code = m.main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
         "print('HEAVY', sorted({k.split('.')[0] for k in sys.modules} & {'torch', 'transformers', 'hf_paged'}))\n"
         "sys.exit(code)")


def front(*args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", FRONT, str(ROOT / "hf_paged" / "cli.py"), *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})})
    return proc, time.perf_counter() - start


def test_help_and_unreachable_model_load_no_torch(tmp_path):
    proc, _ = front("generate", "--help")
    assert proc.returncode == 0, proc.stderr
    for option in ("--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--block-size", "--num-blocks",
                   "--dtype", "--device", "--input", "--output", "--prompt"):
        assert option in proc.stdout
    assert "HEAVY []" in proc.stdout, "--help imported torch / transformers / hf_paged"
    proc, seconds = front("generate", "--model", "some-org/not-cached", "--prompt", "hi",
                          env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)})
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "not in the Hugging Face cache" in proc.stderr, proc.stderr
    assert "HEAVY []" in proc.stdout and seconds < 10


@pytest.mark.parametrize("name", ["throughput", "window", "serve"])
def test_bench_help_loads_no_torch(name):
    proc, _ = front("bench", name, "--help")
    assert proc.returncode == 0, proc.stderr
    assert f"usage: hf-paged bench {name}" in proc.stdout and "--json" in proc.stdout
    assert "HEAVY []" in proc.stdout, "bench --help imported torch / transformers / hf_paged"


def test_serve_help_answers_at_once_and_help_all_reaches_transformers():
    """transformers serve's own help loads transformers (seconds): `hf-paged serve --help` prints hf_paged's short help
    without it; `--help-all` is handed to transformers as --help."""
    from hf_paged_cli.serve_help import serve_help

    proc, _ = front("serve", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage: hf-paged serve" in proc.stdout and "--help-all" in proc.stdout and "tiny" in proc.stdout
    assert "HEAVY []" in proc.stdout, "serve --help imported torch / transformers / hf_paged"
    options = ["serve", "tiny", "--help-all"]
    assert serve_help(options) is False and options == ["serve", "tiny", "--help"]
    assert serve_help(["serve", "tiny", "--port", "8000"]) is False


def test_demo_runs_and_matches_hf(capsys, one_torch_thread):
    assert main(["demo", "--requests", "6", "--max-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "RANDOM weights" in out and "noise" in out
    assert "outputs identical to HF for 6/6 prompts" in out
    assert "hf_paged LLM.generate" in out and "HF generate (padded batch)" in out
    assert "reserved for this workload" in out and "in use at once" in out
    assert "prompt 0 (" in out and "the same tokens" in out


def test_demo_bar_moves_with_each_step(one_torch_thread):
    from hf_paged import LLM, SamplingParams
    from hf_paged.bench.demo import demo_model, paged_run, random_prompts

    model, tok = demo_model()
    updates = []

    class Bar:
        update = staticmethod(updates.append)

    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    tokens, _, peak = paged_run(LLM(model, tokenizer=tok, num_blocks=32), random_prompts(3, 4096, 0), params, Bar())
    assert len(updates) == 4 and sum(updates) == 12 and [len(t) for t in tokens] == [4, 4, 4] and peak > 0


def write_lines(path: Path, lines: list) -> None:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))


def test_generate_jsonl_in_order_resumable_bad_lines_skipped(tmp_path, one_torch_thread):
    prompts = tmp_path / "prompts.jsonl"
    write_lines(prompts, [{"id": "a", "prompt": "Hello there"}, "{not json", {"id": "b", "messages": [
        {"role": "user", "content": "Hi!"}]}, "", {"no_prompt": 1}, {"id": "c", "prompt": "x" * 40}])
    out = tmp_path / "out.jsonl"
    proc = subprocess.run([sys.executable, "-m", "hf_paged.cli", "generate", "--model", "tiny", "--input", str(prompts),
                           "--output", str(out), "--max-tokens", "5", "--no-progress"], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr  # two lines were skipped
    assert f"{prompts}:2: skipped: not JSON" in proc.stderr and f"{prompts}:5: skipped" in proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["input_line"] for r in rows] == [1, 3, 6] and [r["id"] for r in rows] == ["a", "b", "c"]
    assert rows[1]["prompt"] == "[user] Hi!\n[assistant] " and rows[1]["messages"][0]["content"] == "Hi!"
    assert all(len(r["token_ids"]) == 5 and r["finish_reason"] == "length" and isinstance(r["text"], str)
               for r in rows)

    from hf_paged import LLM, SamplingParams
    from hf_paged.tiny import tiny_chat_model

    model, tok = tiny_chat_model()
    ref = LLM(model, tokenizer=tok).generate(["Hello there", "x" * 40], SamplingParams(max_tokens=5, temperature=0),
                                              use_tqdm=False)
    assert [rows[0]["token_ids"], rows[2]["token_ids"]] == [list(o.outputs[0].token_ids) for o in ref]

    # an interrupted run: the last line lost, a torn line left behind; the rerun completes exactly the rest
    text = out.read_text().splitlines(keepends=True)
    out.write_text("".join(text[:2]) + text[2][:10])
    assert main(["generate", "--model", "tiny", "--input", str(prompts), "--output", str(out), "--max-tokens", "5",
                 "--no-progress"]) == 1
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows


def test_txt_prompts_and_one_off_prompts_echoed(tmp_path, capsys, one_torch_thread):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\n\nsecond prompt\n")
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--model", "tiny", "--input", str(prompts), "--output", str(out), "--max-tokens", "3",
                 "--no-progress"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["prompt"], r["input_line"]) for r in rows] == [("first prompt", 1), ("second prompt", 3)]
    assert main(["generate", "--model", "tiny", "--prompt", "Alpha", "--prompt", "Beta", "--max-tokens", "3"]) == 0
    shown = capsys.readouterr().out
    assert shown.index("=== prompt 1 ===\nAlpha\n=== completion (3 tokens") < shown.index("=== prompt 2 ===\nBeta\n")


def test_local_model_folder(tmp_path, capsys, one_torch_thread):
    from hf_paged.tiny import tiny_chat_model

    model, tok = tiny_chat_model()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    argv = ["generate", "--model", str(tmp_path), "--prompt", "Hi", "--max-tokens", "3", "--dtype", "float32"]
    assert main(argv) == 0
    assert "=== prompt 1 ===\nHi\n=== completion (3 tokens" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "tiny", "--input", "missing.txt", "--output", "o.jsonl"], "does not exist"),
    (["generate", "--model", "tiny", "--prompt", "x", "--temperature", "-1"], "temperature"),
])
def test_user_errors_are_one_line(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_resume_after_a_whole_last_line_without_its_newline(tmp_path, one_torch_thread):
    """The last record complete but its newline lost (killed between the two writes): the rerun must not glue the
    next record onto it."""
    prompts, out = tmp_path / "prompts.txt", tmp_path / "out.jsonl"
    prompts.write_text("one\ntwo\nthree\n")
    argv = ["generate", "--model", "tiny", "--input", str(prompts), "--output", str(out), "--max-tokens", "3",
            "--no-progress"]
    assert main(argv) == 0
    whole = out.read_text()
    lines = whole.splitlines(keepends=True)
    out.write_text(lines[0] + lines[1].rstrip("\n"))
    assert main(argv) == 0
    assert out.read_text() == whole
    assert [json.loads(line)["input_line"] for line in out.read_text().splitlines()] == [1, 2, 3]


@pytest.mark.parametrize("options, message", [
    (["--output", "missing/out.jsonl"], "the folder missing does not exist"),
    (["--output", "."], "--output . is a folder"),
    (["--output", "o.jsonl", "--block-size", "3"], "--block-size must be a power of two, got 3"),
    (["--output", "o.jsonl", "--num-blocks", "0"], "--num-blocks must be an integer >= 1, got 0"),
    (["--output", "o.jsonl", "--max-num-seqs", "0"], "--max-num-seqs must be an integer >= 1, got 0"),
])
def test_bad_output_and_engine_options_are_one_line(options, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("p.txt").write_text("hello\n")
    assert main(["generate", "--model", "tiny", "--input", "p.txt", *options]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not Path("o.jsonl").exists()  # refused before anything ran


def test_a_rerun_with_other_generation_options_is_refused(tmp_path, capsys, one_torch_thread):
    prompts, out = tmp_path / "prompts.txt", tmp_path / "out.jsonl"
    prompts.write_text("one\ntwo\n")
    argv = ["generate", "--model", "tiny", "--input", str(prompts), "--output", str(out), "--no-progress"]
    assert main([*argv, "--max-tokens", "3"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    before = out.read_text()
    capsys.readouterr()
    for other, differ in ((["--max-tokens", "4"], "--max-tokens 3 there, 4 now"),
                          (["--max-tokens", "3", "--temperature", "0.5", "--seed", "1"],
                           "--temperature 0.0 there, 0.5 now, --seed None there, 1 now")):
        assert main([*argv, *other]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and differ in err and "new --output" in err and str(out) in err, err
        assert out.read_text() == before
    assert rows[0]["options"] == {"max_tokens": 3, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None}
    # a file of an older version (no "options" in its lines) is still resumed as it is
    out.write_text(json.dumps({k: v for k, v in rows[0].items() if k != "options"}) + "\n")
    assert main([*argv, "--max-tokens", "3"]) == 0
    assert [json.loads(line)["token_ids"] for line in out.read_text().splitlines()] == [r["token_ids"] for r in rows]
