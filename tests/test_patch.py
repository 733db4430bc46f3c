"""integrations/patch.py: hf_paged's changes to transformers are version-checked, idempotent and reversible:
`disable()` puts back everything `enable()` replaced (generate, the pipeline, continuous batching, the config
property, the attention registration), and `enable()` brings it all back."""
import pytest
from transformers import AttentionInterface, PreTrainedConfig
from transformers.generation.continuous_batching.continuous_api import ContinuousMixin
from transformers.generation.utils import GenerationMixin
from transformers.pipelines.base import Pipeline
from transformers.pipelines.text_generation import TextGenerationPipeline

import hf_paged
from hf_paged.integrations import patch


def patched_things():
    return (GenerationMixin.generate, ContinuousMixin.init_continuous_batching,
            ContinuousMixin.destroy_cached_continuous_batching_manager,
            vars(PreTrainedConfig)["_attn_implementation"], "paged" in AttentionInterface._global_mapping)


def test_disable_puts_back_what_enable_replaced_and_enable_is_idempotent():
    enabled = patched_things()
    assert enabled[-1] and hf_paged.is_enabled()
    hf_paged.enable()
    assert patched_things() == enabled  # enabling twice changes nothing
    hf_paged.disable()
    try:
        plain = patched_things()
        assert not plain[-1] and all(a is not b for a, b in zip(plain[:-1], enabled[:-1]))
        assert not hasattr(plain[3].fget, "hf_paged_original")  # transformers' own getter
        hf_paged.disable()  # disabling twice changes nothing
        assert patched_things() == plain
    finally:
        hf_paged.enable()
    assert patched_things()[-1] and hf_paged.is_enabled()


def test_an_unsupported_transformers_is_refused_naming_the_version(monkeypatch):
    hf_paged.disable()
    try:
        monkeypatch.setattr(patch, "_version", lambda: (5, 1))
        with pytest.raises(ImportError, match=r"needs transformers >=5.24,<6; found 5.1"):
            hf_paged.enable()
        assert not hf_paged.is_enabled()
    finally:
        monkeypatch.undo()
        hf_paged.enable()


def test_disable_restores_the_pipeline():
    assert TextGenerationPipeline.get_iterator is not Pipeline.get_iterator
    hf_paged.disable()
    try:
        assert TextGenerationPipeline.get_iterator is Pipeline.get_iterator
    finally:
        hf_paged.enable()
