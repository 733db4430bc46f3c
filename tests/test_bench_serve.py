"""bench/serve.py without starting a server: its prompts, the two server commands, which engine a server runs,
one streaming request (through a stand-in client), the latency / throughput summary, a server that dies at start,
the missing-extra exit, and the report's ratios and verdict."""
import asyncio
import io
import json
import os
import sys
import urllib.error
from pathlib import Path

import pytest

from hf_paged.bench import serve


def test_prompts_are_seeded_printable_ascii():
    prompts = serve.make_prompts(20)
    assert prompts == serve.make_prompts(20) and prompts != serve.make_prompts(20, seed=1)
    assert all(64 <= len(p) <= 160 and all(32 <= ord(c) < 127 for c in p) for p in prompts)


def test_server_commands():
    folder = Path("model")
    ours = serve.server_command("hf_paged", folder, 8123, 16)
    theirs = serve.server_command("transformers", folder, 8123, 16)
    assert ours[0] == theirs[0] == sys.executable
    options = ["model", "--host", "127.0.0.1", "--port", "8123", "--cb-num-blocks", "16", "--log-level", "warning"]
    assert ours[-len(options) - 1:] == ["serve", *options] and "hf_paged_cli" in ours[2]
    assert theirs[-len(options) - 2:] == ["serve", "--continuous-batching", *options] and "transformers" in theirs[2]
    assert "hf_paged" not in theirs[2]  # transformers' server runs without hf_paged imported


def test_environment_is_offline_and_finds_this_checkout(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "elsewhere")
    env = serve.environment()
    assert env["HF_HUB_OFFLINE"] == "1" and env["PYTHONPATH"].split(os.pathsep) == [str(serve.ROOT), "elsewhere"]


def test_free_port_is_bindable():
    import socket

    port = serve.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_engine_of(monkeypatch):
    def not_found(url):
        raise urllib.error.HTTPError(url, 404, "not found", {}, io.BytesIO())

    monkeypatch.setattr(serve, "get", not_found)
    assert serve.engine_of("http://x", "m") == "transformers"
    monkeypatch.setattr(serve, "get", lambda url: {"m": {"hf_paged": True}})
    assert serve.engine_of("http://x", "m") == "hf_paged"
    monkeypatch.setattr(serve, "get", lambda url: {"m": {"hf_paged": False}})
    assert serve.engine_of("http://x", "m") == "transformers (through hf-paged serve)"

    def broken(url):
        raise urllib.error.HTTPError(url, 500, "boom", {}, io.BytesIO())

    monkeypatch.setattr(serve, "get", broken)
    with pytest.raises(urllib.error.HTTPError):
        serve.engine_of("http://x", "m")


class Chunk:
    def __init__(self, text):
        self.choices = [type("Choice", (), {"text": text})()] if text is not None else []


class Client:
    """What one_request uses of openai.AsyncOpenAI: completions.create(stream=True) -> async chunks."""

    def __init__(self, texts):
        self.texts, self.calls = texts, []
        self.completions = self

    async def create(self, **kwargs):
        self.calls.append(kwargs)

        async def stream():
            for text in self.texts:
                yield Chunk(text)
        return stream()


def test_one_request_times_each_text_chunk_and_counts_characters():
    client = Client(["a", "", None, "bc", "d"])
    r = asyncio.run(serve.one_request(client, "m", "hello", 4))
    assert r["tokens"] == 4 and len(r["times"]) == 3 and r["sent"] <= r["times"][0] <= r["times"][-1]
    (call,) = client.calls
    assert call["stream"] is True and call["temperature"] == 0 and call["max_tokens"] == 4
    assert call["extra_body"] == serve.NO_EOS and json.loads(call["extra_body"]["generation_config"]) == {
        "eos_token_id": -1}


def test_summarize():
    requests = [{"sent": 0.0, "times": [0.1, 0.2, 0.4], "tokens": 3},
                {"sent": 0.05, "times": [0.3, 0.5, 0.6], "tokens": 4}]
    s = serve.summarize(requests, 3)
    assert s["requests"] == 2 and s["tokens"] == 7 and s["complete"] is False  # the second gave 4, not 3
    assert s["wall_s"] == 0.6 and s["output_tok_s"] == round(7 / 0.6, 1)
    assert s["ttft_p50_ms"] == pytest.approx(175.0)  # 100 and 250 ms
    assert s["itl_p50_ms"] == pytest.approx(150.0)  # gaps 100, 200, 200, 100 ms
    assert s["tpot_p50_ms"] == pytest.approx((150.0 + 100.0) / 2)  # (0.4 - 0.1) / 2, (0.6 - 0.3) / 3
    assert s["tokens_per_chunk"] == round(7 / 6, 2)
    assert serve.summarize([{"sent": 0.0, "times": [1.0, 2.0], "tokens": 2}], 2)["complete"] is True


def test_a_server_that_dies_at_start_is_an_error_with_its_log(monkeypatch, tmp_path):
    monkeypatch.setattr(serve, "server_command", lambda *args: [sys.executable, "-c",
                                                                "print('cannot load the model'); raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match="hf_paged server did not start:\n.*cannot load the model"):
        serve.start("hf_paged", tmp_path, 4, tmp_path / "log.txt", timeout=60)


def test_without_the_serve_extra_it_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "openai", None)
    assert serve.main(["--small"]) == 2
    assert "pip install 'hf_paged[serve]'" in capsys.readouterr().err


def test_report(monkeypatch, tmp_path, capsys):
    pytest.importorskip("openai")
    saved, ran = [], []
    monkeypatch.setattr(serve, "save_model", lambda folder, sizes: saved.append(sizes))

    def run_system(system, folder, setup, prompts, logs, timeout):
        ran.append((system, setup["clients"], setup["max_tokens"], len(prompts)))
        fast = system == "hf_paged"
        return {"output_tok_s": 300.0 if fast else 100.0, "ttft_p50_ms": 1.0, "ttft_p99_ms": 2.0,
                "itl_p50_ms": 1.0, "itl_p99_ms": 4.0 if fast else 5.0, "tpot_p50_ms": 1.0, "tpot_p99_ms": 1.0,
                "tokens_per_chunk": 1.0, "startup_s": 1.0}

    monkeypatch.setattr(serve, "run_system", run_system)
    out = tmp_path / "s.json"
    assert serve.main(["--small", "--clients", "3", "--json", str(out)]) == 0
    assert saved == [serve.SMALL["model"]] and ran == [("hf_paged", 3, 8, 3), ("transformers", 3, 8, 3)]
    report = json.loads(out.read_text())
    assert report["throughput_ratio"] == 3.0 and report["itl_p99_ratio"] == 0.8 and report["goal_met"] is True
    assert report["setup"]["clients"] == 3 and report["setup"]["num_blocks"] == 16
    assert "3.0x output tok/s" in capsys.readouterr().out
    assert serve.main(["--small", "--systems", "hf_paged", "--json", str(out)]) == 0
    assert "throughput_ratio" not in json.loads(out.read_text())  # nothing to compare with
