"""integrations/in_place.py: when generate in HF's own loop on a PagedCache may read the pages in place: only sdpa
models whose every layer goes through the attention interface and that pass the probe (its answer kept on the model),
never when attention weights are asked for. (The calls themselves are test_cache_attention.py's.)"""
import contextlib

from hf_paged.integrations import in_place
from hf_paged.integrations.in_place import in_place_configs
from hf_paged.model import describe_model
from hf_paged.tiny import tiny_model


def test_an_sdpa_model_that_passes_the_probe_reads_in_place_unless_weights_are_asked_for():
    model = tiny_model("llama")
    spec = describe_model(model)
    configs = in_place_configs(model, spec, {}, {})
    assert configs and all(c._attn_implementation == "sdpa" for c in configs)
    assert model.__dict__["_hf_paged_reads_in_place"] is True  # the probe ran once, its answer kept
    assert in_place_configs(model, spec, {}, {"output_attentions": True}) is None


def test_other_attentions_and_a_failed_probe_keep_the_gathered_copy(monkeypatch):
    eager = tiny_model("llama", attn_implementation="eager")
    assert in_place_configs(eager, describe_model(eager), {}, {}) is None

    @contextlib.contextmanager
    def broken(configs, name):
        raise RuntimeError("this model's attention touches the K/V first")
        yield

    monkeypatch.setattr(in_place, "attention_implementation", broken)
    model = tiny_model("llama")
    assert in_place_configs(model, describe_model(model), {}, {}) is None
    assert model.__dict__["_hf_paged_reads_in_place"] is False
