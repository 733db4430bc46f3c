"""`pipeline("text-generation")` with "paged" as ONE engine run for the whole input.

HF's pipeline preprocesses every input, pads inputs into batches of `batch_size` and calls `generate` once per batch.
With "paged" requested (a generate kwarg given at construction or per call, a passed `generation_config`, or the
model's generation config) and settings the engine reproduces exactly, the patched `get_iterator` instead:
preprocesses each input with the pipeline's own `preprocess` (prompts, chat templates, prefixes), queues it on one
engine as it comes (a generator or `KeyDataset` is read as the engine needs work, never all at once), and hands each
finished prompt to the pipeline's own `postprocess`, in input order, as `_forward` would have shaped it for a batch of
one. Anything else keeps HF's batch-by-batch path (where each batch's generate still runs on the engine when it can),
with a one-line warning saying why.

What the engine path reproduces: greedy decoding (token for token; HF's batches are left padded and padding does not
change a row's greedy tokens) and sampling with temperature / top-k / top-p / min-p (the same distribution; random
draws differ from HF's, as they already differ between HF batch sizes), `max_new_tokens`, EOS ids,
`num_return_sequences`. Under `torchrun` / `accelerate launch` (every process must make the call) the inputs are
read at once and the processes compare digests of them: the same inputs everywhere -> each process serves every
`world_size`-th input and every process returns all outputs in input order; different inputs (accelerate's
`split_between_processes`) -> each process serves and returns exactly its own.
"""
from __future__ import annotations

from collections.abc import Sized
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from ..config import EngineConfig, logger
from ..distributed import gather_in_order, plan_processes, split_world
from ..engine import Engine
from ..request import ParentRequest
from ..sampling import SamplingParams
from .generate import wants_paged

# generation options the engine path reproduces (everything else must keep its global default)
_SAMPLING = {"temperature", "top_k", "top_p", "min_p"}
_REPRODUCED = {"max_new_tokens", "max_length", "do_sample", "num_return_sequences", "pad_token_id", "bos_token_id",
               "eos_token_id", "decoder_start_token_id", "use_cache", "cache_implementation", "cache_config",
               "transformers_version", "_from_model_config", "_commit_hash", *_SAMPLING}
# generate arguments the engine path ignores (HF's generate needs them only for stop strings / assisted decoding)
_INERT_KWARGS = {"tokenizer", "prefix_length"}


@dataclass(slots=True)
class EnginePlan:
    """How every prompt of one pipeline call runs: one SamplingParams for all, the engine options, the pad id used to
    line up `num_return_sequences` samples of different lengths (as HF pads them), and the pipeline's forward
    parameters (an empty prompt runs through the pipeline's own forward with them)."""

    params: SamplingParams
    options: dict
    pad: int
    forward_params: dict


def _global_defaults():
    from transformers import GenerationConfig

    reference = GenerationConfig()
    reference.update(**GenerationConfig._get_default_generation_params(), defaults_only=True)
    return reference


def _same(a: Any, b: Any) -> bool:
    return a == b or (not a and not b and a is not True and b is not True)


def _resolve(pipe, generate_kwargs: dict):
    """The generation config HF's `generate` would run this call with, and the non-config kwargs left over."""
    kwargs = {k: v for k, v in generate_kwargs.items() if k not in _INERT_KWARGS}
    config = kwargs.pop("generation_config", None)
    return pipe.model._prepare_generation_config(config, **kwargs)


def _config_reason(config) -> str | None:
    from transformers.generation.configuration_utils import GenerationMode

    mode = config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        return f"generation mode {mode.value!r} is not supported by the paged engine"
    if mode == GenerationMode.GREEDY_SEARCH and config.num_return_sequences != 1:
        return "num_return_sequences > 1 without sampling (HF's generate refuses it)"
    if config.max_new_tokens is None:
        return "max_length without max_new_tokens depends on each batch's padded length"
    reference = _global_defaults().to_dict()
    for key, value in sorted(config.to_dict().items()):
        if key not in _REPRODUCED and key in reference and not _same(value, reference[key]):
            return f"generation option {key}={value!r} is not reproduced by one engine run"
    return None


def _post_reason(pipe, postprocess_params: dict) -> str | None:
    from transformers.pipelines.text_generation import ReturnType

    if postprocess_params.get("return_type") == ReturnType.TENSORS:
        return "return_tensors=True returns HF's padded batch rows"
    if postprocess_params.get("skip_special_tokens") is False or getattr(pipe.tokenizer, "response_template", None):
        return "texts that keep special tokens would show HF's batch padding"
    return None


def engine_plan(pipe, forward_params: dict, postprocess_params: dict) -> tuple[EnginePlan | None, str | None]:
    """The plan for one engine run, or (None, why HF's batch-by-batch path must run instead)."""
    generate_kwargs = pipe._prepare_generate_kwargs({k: v for k, v in forward_params.items() if k != "prefix_length"})
    config, model_kwargs = _resolve(pipe, generate_kwargs)
    odd = sorted(k for k, v in model_kwargs.items() if v is not None)
    if odd:
        return None, f"generate arguments {odd} are not supported by one engine run"
    reason = _config_reason(config) or _post_reason(pipe, postprocess_params)
    if reason is not None:
        return None, reason
    eos = config.eos_token_id
    eos = [] if eos is None else [int(t) for t in (eos if isinstance(eos, (list, tuple)) else [eos])]
    sampling = dict(temperature=config.temperature, top_k=config.top_k or 0, top_p=config.top_p,
                    min_p=config.min_p or 0.0) if config.do_sample else dict(temperature=0.0)
    params = SamplingParams(max_tokens=config.max_new_tokens, n=config.num_return_sequences, ignore_eos=True,
                            stop_token_ids=eos, **sampling)
    options = dict(config.cache_config or {})
    EngineConfig.from_dict(options).validate()  # bad engine options: a clear error before any work
    if config.do_sample and options.get("seed") is None:  # as HF's sampling: reproducible under torch.manual_seed
        options["seed"] = int(torch.randint(0, 2**62, ()).item())
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
    return EnginePlan(params, options, int(pad), dict(forward_params)), None


def _items(inputs: Any) -> Iterable[Any]:
    """The inputs one by one, read as they are needed (an indexable dataset by index, as HF's pipeline reads it)."""
    if isinstance(inputs, Sized) and hasattr(inputs, "__getitem__") and not isinstance(inputs, (list, tuple)):
        return (inputs[i] for i in range(len(inputs)))
    return inputs


def _model_outputs(model_inputs: dict, parent: ParentRequest, pad: int) -> dict:
    """What `_forward` returns for a batch of one: the prompt, then each sample's tokens padded to the longest."""
    failed = [r for r in parent.samples if r.finish_reason == "error"]
    if failed:
        raise RuntimeError(f"hf_paged pipeline: input {parent.index} failed: {failed[0].error}")
    prompt = model_inputs["input_ids"]
    rows = [r.output_token_ids for r in parent.samples]
    width = max(len(row) for row in rows)
    new = torch.tensor([row + [pad] * (width - len(row)) for row in rows], dtype=torch.long)
    sequences = torch.cat([prompt.cpu().expand(len(rows), -1), new], dim=1)
    return {"generated_sequence": sequences[None], "input_ids": prompt, "prompt_text": model_inputs["prompt_text"]}


def run_on_engine(pipe, engine: Engine, items: Iterable[tuple[int, Any]], plan: EnginePlan, preprocess_params: dict,
                  postprocess_params: dict) -> Iterator[tuple[int, Any]]:
    """(index, postprocessed output) for every item, in the order of `items`. Items are preprocessed and queued while
    fewer than 2 * max_num_seqs prompts are unfinished; an exception or an abandoned iterator aborts what is queued.
    Empty prompts (HF starts them from BOS) go through the pipeline's own forward, alone."""
    source = iter(items)
    pending: list[tuple[int, dict, ParentRequest | None]] = []
    limit = 2 * engine.config.max_num_seqs
    exhausted = False
    try:
        while pending or not exhausted:
            while not exhausted and sum(g is not None and not g.is_finished for _, _, g in pending) < limit:
                try:
                    index, item = next(source)
                except StopIteration:
                    exhausted = True
                    break
                model_inputs = pipe.preprocess(item, **preprocess_params)
                ids = model_inputs["input_ids"][0].tolist()
                parent = engine.add_request(ids, plan.params, index=index) if ids else None
                pending.append((index, model_inputs, parent))
            while pending and (pending[0][2] is None or pending[0][2].is_finished):
                index, model_inputs, parent = pending.pop(0)
                yield index, _finish(pipe, engine, model_inputs, parent, plan, postprocess_params)
            if pending and engine.has_unfinished:
                engine.step()
    finally:
        for _, _, parent in pending:
            if parent is not None:
                engine.abort(parent.request_id)


def _finish(pipe, engine: Engine, model_inputs: dict, parent: ParentRequest | None, plan: EnginePlan,
            postprocess_params: dict):
    if parent is None:
        model_outputs = pipe.forward(model_inputs, **plan.forward_params)
    else:
        engine.release(parent)
        model_outputs = _model_outputs(model_inputs, parent, plan.pad)
    return pipe.postprocess(model_outputs, **postprocess_params)


def paged_outputs(pipe, inputs, plan: EnginePlan, preprocess_params: dict, postprocess_params: dict) -> Iterator[Any]:
    """The pipeline's outputs for `inputs`, in input order, from one engine run (in a multi-process run where every
    process passed the same inputs, this process's share of it, whose results are then gathered on every process)."""
    world, options = plan_processes(pipe.model, plan.options, pipe.model.device)
    if world.is_parallel:  # read at once: split only if every process passed the same inputs and options
        def read():
            items = list(_items(inputs))
            return items, (len(items), items, plan.params, preprocess_params, postprocess_params)

        inputs, world = split_world(world, read)
    engine = Engine(pipe.model, None, EngineConfig.from_dict(options))
    items = world.shard(inputs) if world.is_parallel else enumerate(_items(inputs))
    results = run_on_engine(pipe, engine, items, plan, preprocess_params, postprocess_params)
    if not world.is_parallel:
        for _, output in results:
            yield output
        return
    yield from gather_in_order(world, list(results), len(inputs))


def paged_get_iterator(original, pipe, inputs, num_workers, batch_size, preprocess_params, forward_params,
                       postprocess_params):
    """The body of the patched `TextGenerationPipeline.get_iterator`."""
    generate_kwargs = pipe._prepare_generate_kwargs({k: v for k, v in forward_params.items() if k != "prefix_length"})
    if not wants_paged(pipe.model, generate_kwargs, generate_kwargs.get("generation_config")):
        return original(pipe, inputs, num_workers, batch_size, preprocess_params, forward_params, postprocess_params)
    plan, reason = engine_plan(pipe, forward_params, postprocess_params)
    if reason is not None:
        logger.warning("hf_paged: pipeline runs batch by batch: %s", reason)
        return original(pipe, inputs, num_workers, batch_size, preprocess_params, forward_params, postprocess_params)
    return paged_outputs(pipe, inputs, plan, preprocess_params, postprocess_params)
