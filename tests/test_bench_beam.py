"""bench/beam.py: its options, the KV bytes it reports for each cache (PagedCache: distinct blocks held, shared ones
once; DynamicCache: its tensors), the equality check it makes, and a smallest whole run's JSON."""
import json
from types import SimpleNamespace

import pytest
import torch

from hf_paged.bench import beam

# the --small model: 2 layers, 2 KV heads of 64 / 4 = 16 dims, fp32: bytes of K and V for one token, every layer
TOKEN_BYTES = 2 * 2 * 2 * 16 * 4


def test_options():
    args = beam.parse_args([])
    assert (args.prompt_len, args.beams, args.new_tokens, args.block_size) == (1000, [4, 8], 32, 16)
    assert args.arch == "llama" and args.window == 256 and not args.small and args.json == "hf-paged-bench-beam.json"
    args = beam.parse_args(["--beams", "2", "3", "--arch", "gemma2", "--window", "8", "--small"])
    assert args.beams == [2, 3] and args.arch == "gemma2" and args.window == 8 and args.small
    with pytest.raises(SystemExit) as stop:
        beam.parse_args(["--arch", "gpt2"])
    assert stop.value.code == 2


def test_help_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as stop:
        beam.parse_args(["--help"])
    assert stop.value.code == 0 and "--new-tokens" in capsys.readouterr().out


def test_build_model_sizes_and_window():
    small = beam.build_model(True)
    assert (small.config.hidden_size, small.config.num_hidden_layers, small.config.vocab_size) == (64, 2, 1000)
    windowed = beam.build_model(True, "mistral", window=24)
    assert windowed.config.sliding_window == 24


def test_dynamic_bytes_counts_every_key_and_value_tensor():
    layers = [SimpleNamespace(keys=torch.zeros(2, 3, 5, dtype=torch.float16), values=torch.zeros(2, 3, 5)),
              SimpleNamespace(keys=None, values=None)]  # a layer that holds nothing yet
    assert beam.dynamic_bytes(SimpleNamespace(layers=layers)) == 30 * 2 + 30 * 4


def test_measure_reports_distinct_blocks_and_dynamic_tensors(one_torch_thread):
    """Two beams over a 24-token prompt, 3 new tokens, blocks of 16: both beams share the prompt's full block and
    each holds its own second block (3 distinct blocks); DynamicCache holds 2 rows of 26 tokens (the last token's
    K/V is never computed)."""
    model = beam.build_model(True)
    prompt = torch.randint(3, 1000, (1, 24), generator=torch.Generator().manual_seed(0))
    r = beam.measure(model, prompt, 2, 3, 16)
    assert r["num_beams"] == 2 and r["identical"] is True
    assert r["paged_bytes"] == 3 * 16 * TOKEN_BYTES
    assert r["dynamic_bytes"] == 2 * 26 * TOKEN_BYTES
    assert r["saving"] == pytest.approx(1 - r["paged_bytes"] / r["dynamic_bytes"])
    assert r["paged_s"] > 0 and r["dynamic_s"] > 0


def test_measure_refuses_different_outputs(monkeypatch, one_torch_thread):
    model = beam.build_model(True)
    real = model.generate

    def generate(*args, **kwargs):  # the paged call answers something else
        out = real(*args, **kwargs)
        if "cache" in kwargs:
            out.sequences[:, -1] += 1
        return out

    monkeypatch.setattr(model, "generate", generate)
    with pytest.raises(AssertionError, match="num_beams=2: PagedCache and DynamicCache outputs differ"):
        beam.measure(model, torch.randint(3, 1000, (1, 8)), 2, 2, 16)


def test_smallest_run_writes_its_report(tmp_path, capsys, one_torch_thread):
    out = tmp_path / "beam.json"
    assert beam.main(["--small", "--prompt-len", "24", "--beams", "2", "--new-tokens", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "beam" and report["arch"] == "llama" and report["sliding_window"] is None
    assert (report["prompt_len"], report["new_tokens"], report["block_size"], report["small"]) == (24, 3, 16, True)
    (result,) = report["results"]
    assert result["num_beams"] == 2 and result["paged_bytes"] == 3 * 16 * TOKEN_BYTES
    assert report["greedy"]["rows"] == 4 and set(report["greedy"]) == {"rows", "dynamic_s", "paged_s",
                                                                       "paged_gathered_s"}
    printed = capsys.readouterr().out
    assert "24-token prompt, 3 new tokens, identical outputs" in printed and f"written to {out}" in printed


def test_small_caps_the_prompt_and_tokens(monkeypatch, tmp_path, one_torch_thread):
    seen = []
    monkeypatch.setattr(beam, "measure", lambda model, prompt, beams, new, block: seen.append(
        (prompt.shape[1], beams, new)) or {"num_beams": beams, "paged_bytes": 1, "dynamic_bytes": 2, "saving": 0.5,
                                            "paged_s": 1.0, "dynamic_s": 1.0, "identical": True})
    monkeypatch.setattr(beam, "time_greedy", lambda model, rows, new, block: seen.append(("greedy", rows.shape, new))
                        or {"rows": 4, "dynamic_s": 1.0, "paged_s": 1.0, "paged_gathered_s": 1.0})
    assert beam.main(["--small", "--beams", "3", "--json", str(tmp_path / "b.json")]) == 0
    assert seen == [(32, 2, 2), (200, 3, 8), ("greedy", (4, 200), 16)]  # warm-up, the measured beams, greedy
