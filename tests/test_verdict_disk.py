"""model/verdict_disk.py: the start-up check's pass and the padding probe's answer kept on disk for later processes,
read only where everything that decides them is the same."""
import functools
import json
import os
import subprocess
import sys

import pytest
import torch

from hf_paged import LLM, SamplingParams
from hf_paged.model import probe, verdict_disk
from hf_paged.tiny import tiny_model


@pytest.fixture
def disk(monkeypatch, tmp_path):
    """The cache on (the suite turns it off), in a folder of this test's own."""
    monkeypatch.setenv(verdict_disk.SWITCH, "1")
    where = tmp_path / "verdicts"
    monkeypatch.setattr(verdict_disk, "folder", lambda: where)
    return where


def forwards_counted(monkeypatch):
    """How many forwards the check and the padding probe run (their paged and own logits)."""
    calls = []
    for name in ("_paged_logits", "_own_logits"):
        original = getattr(probe, name)
        monkeypatch.setattr(probe, name, lambda *a, _o=original, _n=name, **k: calls.append(_n) or _o(*a, **k))
    return calls


def generate(model):
    out = LLM(model).generate([[5, 9, 14, 3, 22], [8, 1, 30]], SamplingParams(max_tokens=6, temperature=0.0),
                              use_tqdm=False)
    return [o.outputs[0].token_ids for o in out]


def test_a_pass_is_read_by_a_later_process_instead_of_checked(monkeypatch, disk):
    first = tiny_model("mistral", sliding_window=8)
    calls = forwards_counted(monkeypatch)
    want = generate(first)
    assert calls and len(list(disk.glob("check_*.json"))) == 1
    windows = first.__dict__["_hf_paged_window"]
    calls.clear()
    again = tiny_model("mistral", sliding_window=8)  # a new model object: what a new process has
    assert generate(again) == want
    assert calls == []  # no forward of the check: read from disk
    assert again.__dict__["_hf_paged_window"] == windows  # the layers' windows too (the KV groups depend on them)
    assert any(pair != (None, None) for pair in next(iter(windows.values())).values())


def test_the_padding_answer_is_kept_too(disk):
    assert probe.counts_padding(tiny_model("llama")) is False
    (stored,) = disk.glob("padding_*.json")
    data = json.loads(stored.read_text())
    stored.write_text(json.dumps(dict(data, answer=True)))  # what a later process reads, not what it would measure
    assert probe.counts_padding(tiny_model("llama")) is True


class Marked(torch.Tensor):
    """A tensor subclass of the same shape and dtype."""


def identity(model, key=("check",)):
    return verdict_disk.identity(model, [model.config], key)


def test_what_decides_the_answer_changes_the_identity(monkeypatch):
    import transformers.models.llama.modeling_llama as modeling

    base = identity(tiny_model("llama"))
    assert identity(tiny_model("llama", seed=3)) == base  # other weights' values: the same code and shapes
    assert identity(tiny_model("llama"), key=("check", "bfloat16")) != base  # the caller's key
    assert identity(tiny_model("llama", rope_theta=500.0)) != base  # any config field
    assert identity(tiny_model("llama").to(torch.bfloat16)) != base  # the weights' dtype
    monkeypatch.setenv("HF_PAGED_CPU_PREFILL", "0")
    assert identity(tiny_model("llama")) != base  # hf_paged's switches (other kernels)
    monkeypatch.delenv("HF_PAGED_CPU_PREFILL")
    grown = tiny_model("llama")
    grown.register_buffer("extra", torch.zeros(3))
    assert identity(grown) != base  # parameters' and buffers' names and shapes
    wrapped = tiny_model("llama")
    head = wrapped.lm_head
    head.weight = torch.nn.Parameter(Marked(head.weight.detach()), requires_grad=False)
    assert identity(wrapped) != base  # and classes (a quantizing library's tensor subclass)
    original = modeling.apply_rotary_pos_emb
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(modeling, "apply_rotary_pos_emb", lambda q, k, cos, sin, *a, **kw: original(q, k, cos, sin))
        assert identity(tiny_model("llama")) != base  # a function patched into the model's module
    assert identity(tiny_model("llama")) == base
    wrapped = []
    for function in (lambda q, k, cos, sin: (q, k), lambda q, k, cos, sin: (k, q)):
        with pytest.MonkeyPatch.context() as patch:  # cached wrappers (no code of their own) of other functions
            patch.setattr(modeling, "apply_rotary_pos_emb", functools.lru_cache(function))
            wrapped.append(identity(tiny_model("llama")))
    assert len({base, *wrapped}) == 3
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(modeling.LlamaMLP, "forward", lambda self, x: self.down_proj(self.up_proj(x)))
        assert identity(tiny_model("llama")) != base  # a method patched into one of its classes


def test_something_attached_to_an_instance_has_no_identity():
    model = tiny_model("llama")
    layer = model.model.layers[0]
    layer.mlp.forward = lambda x: x
    assert identity(model) is None
    model = tiny_model("llama")
    handle = model.model.norm.register_forward_hook(lambda *a: None)
    assert identity(model) is None
    handle.remove()
    assert identity(model) is not None
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert identity(model) is None
    finally:
        handle.remove()


def test_the_identity_is_the_same_in_another_process():
    """Also for code whose constants include a set of strings (its order follows the process's string hashes)."""
    script = ("import hashlib, hf_paged\nfrom hf_paged.tiny import tiny_model\n"
              "from hf_paged.model import verdict_disk\n"
              "def named(x):\n    return x in {'alpha', 'beta', 'gamma', 'delta', 'epsilon', 'zeta'}\n"
              "m = tiny_model('qwen2'); print(verdict_disk.identity(m, [m.config], ('check',)), "
              "hashlib.sha256(verdict_disk._code(named)).hexdigest())")
    seen = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2", "3")}
    assert len(seen) == 1 and len(next(iter(seen)).split()) == 2


def test_refusals_are_not_kept(monkeypatch, disk):
    monkeypatch.setattr(probe, "_worst", lambda paged, own: 1.0)  # as if the logits parted
    with pytest.raises(ValueError, match="does not reproduce"):
        LLM(tiny_model("llama"))
    assert not disk.exists() or not list(disk.glob("check_*.json"))


def test_damaged_untrusted_or_switched_off_files_are_not_read(monkeypatch, disk):
    generate(tiny_model("llama"))
    (stored,) = disk.glob("check_*.json")
    calls = forwards_counted(monkeypatch)
    for damage in ("not json", json.dumps({"identity": "another", "answer": []})):
        stored.write_text(damage)
        generate(tiny_model("llama"))
        assert calls, damage
        calls.clear()
    assert json.loads(stored.read_text())["identity"] != "another"  # the check that ran wrote it again
    generate(tiny_model("llama"))
    assert calls == []
    os.chmod(stored, 0o666)  # others may write it: not trusted
    generate(tiny_model("llama"))
    assert calls
    calls.clear()
    os.chmod(stored, 0o600)
    monkeypatch.setenv(verdict_disk.SWITCH, "0")
    generate(tiny_model("llama"))
    assert calls
    calls.clear()
    monkeypatch.setenv(verdict_disk.SWITCH, "1")
    generate(tiny_model("llama"))
    assert calls == []


def test_the_attention_modules_kv_shapes_are_kept_too(monkeypatch, disk):
    from hf_paged.model import spec

    model = tiny_model("qwen3", head_dim=24)  # K/V heads of 24: what the modules produce, not hidden / heads
    want = spec.describe_model(model).kv
    assert len(list(disk.glob("kv_shapes_*.json"))) == 1
    monkeypatch.setattr(spec, "_recorded_shapes", lambda *a: pytest.fail("recorded the shapes again"))
    again = spec.describe_model(tiny_model("qwen3", head_dim=24)).kv
    assert (again.num_kv_heads, again.head_dim, again.layer_shapes) == (want.num_kv_heads, want.head_dim,
                                                                         want.layer_shapes)
    assert want.head_dim == 24


def test_a_model_that_cannot_be_described_is_checked_as_before(monkeypatch, disk):
    model = tiny_model("llama")
    monkeypatch.setattr(type(model.config), "to_json_string", lambda *a, **k: (_ for _ in ()).throw(RuntimeError))
    assert identity(model) is None
    calls = forwards_counted(monkeypatch)
    assert generate(model)
    assert calls and not disk.exists()


def test_no_check_verdict_is_kept_for_state_modules_on_substitute_forwards(monkeypatch, disk):
    """Their substitutes are chosen per process by timing: a pass of one combination must not stand for another."""
    import dataclasses

    from hf_paged.engine import engine

    real = engine.describe_model
    monkeypatch.setattr(engine, "describe_model", lambda *a, **k: dataclasses.replace(real(*a, **k), substituted=True))
    generate(tiny_model("llama"))
    assert not list(disk.glob("check_*.json"))
    monkeypatch.setattr(engine, "describe_model", real)
    generate(tiny_model("llama"))
    assert len(list(disk.glob("check_*.json"))) == 1
