"""The real PEFT library (skipped without it): a persistent LLM on a PeftModel serves 0 stale outputs after the
changes an RL / fine-tuning loop makes (optimizer steps on the LoRA weights, load_state_dict, adapter switch /
disable / merge), and `generate(cache_implementation="paged")` on a PeftModel gives plain generate's tokens.

Every test first shows the shared prefix was reused (else it would prove nothing), then compares with the model's own
HF generate (fp32, greedy) at that moment, PEFT's `hotswap_adapter` included (it copies the new weights in through
`.data`, no version bump: the fingerprint compares the adapter tensors' first and last entries; last tests)."""
import pytest
import torch

peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict  # noqa: E402

from hf_paged import LLM, SamplingParams  # noqa: E402
from hf_paged.tiny import tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SYSTEM = list(range(30, 62))  # a shared "system prompt": four full blocks of 8
NEW = 8
PARAMS = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
ALPHA = 1  # scaling 1/4: the adapter moves the outputs without drowning the base model
PROMPTS = [SYSTEM + [70, 71], SYSTEM + [90]]


def lora_config(seed: int) -> LoraConfig:
    """Seeds the LoRA weights, drawn when the adapter is injected: call it right before."""
    torch.manual_seed(seed)
    return LoraConfig(r=4, lora_alpha=ALPHA, target_modules=["q_proj", "k_proj", "v_proj", "down_proj"],
                      init_lora_weights=False)  # random non-zero A and B: the adapter changes the outputs


def peft_model(seed: int = 3, lora_seed: int = 0):
    base = tiny_model("llama", seed=seed)
    return get_peft_model(base, lora_config(lora_seed)).eval()


@pytest.fixture
def model():
    return peft_model()


def hf_tokens(model, batch=PROMPTS):
    """The model's own greedy generate, fp32, one prompt at a time (no padding)."""
    out = []
    for prompt in batch:
        ids = torch.tensor([prompt])
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(gen[0, len(prompt):].tolist())
    return out


def serve(llm, batch=PROMPTS):
    outs = llm.generate(batch, PARAMS, use_tqdm=False)
    return [o.token_ids for o in outs], [o.num_cached_tokens for o in outs]


def warm_llm(model):
    """A persistent LLM that has served PROMPTS once and reused their shared prefix; returns it and their tokens."""
    llm = LLM(model, block_size=8)
    serve(llm, [SYSTEM + [5]])
    tokens, cached = serve(llm)
    assert cached == [32, 32], "the shared prefix was not reused before the change: the test tests nothing"
    assert tokens == hf_tokens(model)
    return llm, tokens


def assert_fresh(llm, model, before=None):
    """Served after a change: the model's own tokens now; where `before` is given, the change shows in them."""
    tokens, _ = serve(llm)
    assert tokens == hf_tokens(model), "stale: the LLM served K/V computed before the change"
    if before is not None:
        assert tokens != before, "the change does not alter these prompts' tokens: the test tests nothing"
    return tokens


def test_an_optimizer_step_on_the_lora_weights(model):
    llm, before = warm_llm(model)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW(trained, lr=0.05)
    for _ in range(2):
        ids = torch.tensor([SYSTEM + [5, 6, 7]])
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert_fresh(llm, model, before)
    _, cached = serve(llm)
    assert cached == [32, 32]  # reuse resumes under the new weights


@pytest.mark.parametrize("what", ["whole model", "adapter only"])
def test_load_state_dict_of_other_weights(model, what):
    llm, before = warm_llm(model)
    other = peft_model(seed=4, lora_seed=1)
    if what == "whole model":
        model.load_state_dict(other.state_dict())
    else:
        set_peft_model_state_dict(model, get_peft_model_state_dict(other))
    assert_fresh(llm, model, before)


def test_adding_and_switching_to_a_second_adapter(model):
    llm, before = warm_llm(model)
    model.add_adapter("second", lora_config(5))  # inactive: what it computes is unchanged
    assert_fresh(llm, model)
    model.set_adapter("second")
    second = assert_fresh(llm, model, before)
    model.set_adapter("default")
    assert assert_fresh(llm, model, second) == before


def test_disable_adapter_context(model):
    llm, before = warm_llm(model)
    with model.disable_adapter():
        off = assert_fresh(llm, model, before)
    assert assert_fresh(llm, model, off) == before


def test_merge_and_unmerge(model):
    """Merging the active adapter keeps the function (the K/V differ only by rounding: recomputed all the same);
    merging another one while "default" is active computes base + "second"; disable_adapter on merged layers
    unmerges them; unmerge_adapter restores base + "default"."""
    model.add_adapter("second", lora_config(5))
    llm, before = warm_llm(model)
    model.merge_adapter()
    tokens, cached = serve(llm)
    assert tokens == hf_tokens(model) and cached == [0, 32]
    with model.disable_adapter():  # unmerges, then runs the base model alone
        off = assert_fresh(llm, model, before)
    model.merge_adapter(["second"])
    second = assert_fresh(llm, model, before)
    assert second != off
    model.unmerge_adapter()
    assert assert_fresh(llm, model, second) == before


@pytest.mark.parametrize("merged", ["default", "second"])
def test_merge_and_unload(model, merged):
    """The LLM keeps serving the PeftModel whose layers merge_and_unload replaced; merging "second" while "default"
    was active changes the function."""
    model.add_adapter("second", lora_config(5))
    llm, before = warm_llm(model)
    plain = model.merge_and_unload(adapter_names=[merged])
    assert not any("lora_" in name for name, _ in plain.named_parameters())
    if merged == "second":
        assert_fresh(llm, model, before)
    else:  # the same function, other weights (rounding): recomputed, as after merge_adapter
        tokens, cached = serve(llm)
        assert tokens == hf_tokens(model) == before and cached == [0, 32]
    assert serve(llm)[0] == hf_tokens(plain)


def test_paged_generate_on_a_peft_model_equals_plain_generate(model, engine_runs):
    ids = torch.tensor([[0, 0, 0] + SYSTEM[:7], SYSTEM[:10]])
    mask = (torch.arange(10) >= torch.tensor([[3], [0]])).long()
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                  pad_token_id=0)
    plain = model.generate(**kwargs)
    assert not engine_runs
    paged = model.generate(**kwargs, cache_implementation="paged")
    assert len(engine_runs) == 1, "generate did not run on the engine"
    assert torch.equal(paged, plain)
    with model.disable_adapter():
        assert torch.equal(model.generate(**kwargs, cache_implementation="paged"), model.generate(**kwargs))


def _hotswap(model, tmp_path):
    from peft.utils.hotswap import hotswap_adapter

    peft_model(lora_seed=7).save_pretrained(tmp_path)
    hotswap_adapter(model, str(tmp_path), adapter_name="default")


def test_hotswap_adapter_then_reset_prefix_cache(model, tmp_path):
    llm, before = warm_llm(model)
    _hotswap(model, tmp_path)
    llm.reset_prefix_cache()
    assert_fresh(llm, model, before)


def test_hotswap_adapter_is_seen_without_a_reset(model, tmp_path):
    """hotswap_adapter copies the new weights into the old tensors through `.data` (no version bump, same
    storage): seen by the values of the adapter tensors' ends; swapping in the same weights again keeps reuse."""
    llm, before = warm_llm(model)
    _hotswap(model, tmp_path)
    after = assert_fresh(llm, model, before)
    _hotswap(model, tmp_path)
    tokens, cached = serve(llm)
    assert tokens == after and cached == [32, 32]
