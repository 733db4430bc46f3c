"""torchao-quantized models (skipped without torchao; docs/quantized.md): int8 weight-only weights give HF's own
greedy tokens through `generate(cache_implementation="paged")` and a persistent LLM (prefix hits included), quantized
with `quantize_` or loaded with transformers' TorchAoConfig, and the engine's logprob is the quantized model's (not
the float one's); int8 dynamic activations are refused (their per-token
activation rounding turns the last-bit differences of another summation order into whole quantization steps: HF's
own cached forward differs from its whole-prefix forward by more than the probe's tolerance)."""
import pytest
import torch

torchao = pytest.importorskip("torchao")
from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_  # noqa: E402

from hf_paged import LLM, SamplingParams  # noqa: E402
from hf_paged.tiny import tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SYSTEM = list(range(30, 62))
PROMPTS = [SYSTEM + [70, 71], SYSTEM + [90], [5, 6, 7]]
NEW = 12


def hf_tokens(model, **options):
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0, **options)
        out.append(gen[0, len(prompt):].tolist())
    return out


def assert_served_like_hf(model):
    assert type(model.model.layers[0].self_attn.q_proj.weight.data) is not torch.Tensor, "not quantized"
    reference = hf_tokens(model)
    assert hf_tokens(model, cache_implementation="paged") == reference
    llm = LLM(model, block_size=8)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == reference
    again = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.num_cached_tokens for o in again] == [32, 32, 0]
    assert [o.token_ids for o in again] == reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_weight_only_with_quantize_(dtype):
    model = tiny_model("llama", seed=3, dtype=dtype)
    quantize_(model, Int8WeightOnlyConfig())
    assert_served_like_hf(model)


def test_the_engine_runs_the_quantized_weights():
    """The greedy tokens above match the float model's too: the logprob shows which weights ran."""
    model, float_model = tiny_model("llama", seed=3), tiny_model("llama", seed=3)
    quantize_(model, Int8WeightOnlyConfig())
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0)
    out = LLM(model, block_size=8).generate([PROMPTS[0]], params, use_tqdm=False)[0]
    served = out.logprobs[0][out.token_ids[0]]
    with torch.no_grad():
        own, float_own = (torch.log_softmax(m(torch.tensor([PROMPTS[0]])).logits[0, -1], -1)[out.token_ids[0]].item()
                          for m in (model, float_model))
    assert served == pytest.approx(own, abs=1e-5)
    assert abs(own - float_own) > 1e-3


def test_int8_weight_only_loaded_with_torchao_config(tmp_path):
    from transformers import AutoModelForCausalLM, TorchAoConfig

    tiny_model("llama", seed=3).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=TorchAoConfig(Int8WeightOnlyConfig()))
    model.generation_config.pad_token_id = 0
    assert_served_like_hf(model.eval())


def test_int8_dynamic_activations_are_refused_not_served_wrong():
    model = tiny_model("llama", seed=3)
    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    with pytest.raises(ValueError, match="does not reproduce the model's own attention"):
        LLM(model, block_size=8)
