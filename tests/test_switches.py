"""model/switches.py: what hf_paged switches on a model for one forward is switched for the running thread only
(no config is written), instance forwards run their replacement only in the thread that put them there, and every
switch refuses while hf_paged is disabled."""
import threading

import pytest
import torch

import hf_paged  # noqa: F401  (enables: installs the thread-local getter)
from hf_paged.model import switches
from hf_paged.model.switches import HfPagedDisabled, ThreadForward, drop_thread_forwards, switched_attention

from conftest import cached_model


def in_other_thread(call):
    out = []
    thread = threading.Thread(target=lambda: out.append(call()))
    thread.start()
    thread.join()
    return out[0]


def test_the_attention_switch_is_seen_by_this_thread_only_and_undone():
    config = cached_model("llama").config
    plain = config._attn_implementation
    with switched_attention([config], "paged"):
        assert config._attn_implementation == "paged"
        assert in_other_thread(lambda: config._attn_implementation) == plain
        assert "paged" not in repr(vars(config).get("_attn_implementation_internal"))  # nothing written
        with switched_attention([config], "eager"):
            assert config._attn_implementation == "eager"
        assert config._attn_implementation == "paged"  # the outer switch is back
    assert config._attn_implementation == plain


def test_a_thread_forward_runs_its_replacement_only_where_it_was_put():
    module = torch.nn.Identity()
    module.forward = ThreadForward(module, lambda x: x * 2)
    x = torch.ones(2)
    assert torch.equal(module(x), x * 2) and torch.equal(in_other_thread(lambda: module(x)), x)
    holder = torch.nn.Sequential(module)
    assert drop_thread_forwards(holder) == 1 and "forward" not in vars(module) and torch.equal(module(x), x)


def test_switching_while_disabled_refuses_saying_how_to_re_enable(monkeypatch):
    monkeypatch.setattr(switches, "_installer", None)
    with pytest.raises(HfPagedDisabled, match=r"call hf_paged.enable\(\)"):
        with switched_attention([cached_model("llama").config], "paged"):
            pass
    assert not switches.is_enabled()
