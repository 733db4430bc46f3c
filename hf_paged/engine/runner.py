"""Runs one planned step: packs it into a single varlen forward pass of the HF model and samples its tokens."""
from __future__ import annotations

from dataclasses import dataclass

import torch

import time

from ..attention import AttentionBackends, AttentionMetadata, choose_backends
from ..kv import NULL_BLOCK, KVCache
from ..kv.state import StateSlots
from ..kv.slots import slots_of
from ..model import (ExpertProducts, FusedLayers, FusedNorms, FusedRotary, ModelSpec, PagedForwardContext,
                     SmallBatchLinears, StepChoice, forward_lock, paged_attention_active, require_enabled)
from ..model.greedy_head import returned_untouched
from ..model.state_layers import StateStep
from ..sampling import Sampler, picks_by_argmax
from .cuda_graphs import DecodeGraphRunner, DecodeGraphSettings, PaddedDecode
from .plan import Sampled, StepOutcome, StepPlan
from .sample_step import sample_step


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    token_type_ids: torch.Tensor | None  # [1, T] when the requests carry token types
    metadata: AttentionMetadata  # the first KV group's (every group's but for the tables and slots)
    group_metadata: list[AttentionMetadata] | None  # one per KV group when there are several
    states: StateStep | None  # where each sequence's state-layer state is (models with state layers)
    sample_rows: torch.Tensor  # packed row of each sampled request's last token
    sampled: list[int]  # index into the batch of each request that samples this step


def argmax_only(requests: list) -> bool:
    """Every one of `requests` takes its raw logits' first maximum with no sampling hook (`picks_by_argmax`)."""
    return bool(requests) and all(r.controller is None and picks_by_argmax(r.params, r.banned_token_ids())
                                  for r in requests)


class ModelRunner:
    """Turns a `StepPlan` into one `Sampled` per sampled request (`run`); reads requests, changes none.

    Table entries past a sequence's length point at the null block (`metadata` pads with block 0). A request's
    `first_query` becomes one extra query-only sequence after its prompt in the step that completes the prompt: it
    reads the prompt's pages and writes its K/V to the null block."""

    def __init__(self, model: torch.nn.Module, spec: ModelSpec, kv_cache: KVCache, backend: str = "torch",
                 graphs: DecodeGraphSettings | None = None, states: StateSlots | None = None,
                 checkpoints: StateSlots | None = None, backends: AttentionBackends | None = None):
        self.model = model
        self.states, self.checkpoints = states, checkpoints  # state slots, and where state checkpoints go
        self.spec = spec
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = spec.kv.device
        # decides each kind of attention call once
        self.backends = backends if backends is not None else choose_backends(backend, self.device)
        self.block_size = kv_cache.block_size
        self.linears = SmallBatchLinears(model)  # decode-sized steps on CPU: weight-streaming matmuls
        self.norms = FusedNorms(model)  # Llama-family RMSNorms on CPU in one native pass
        self.rotary = FusedRotary(model)  # and their rotary embeddings
        self.layers = FusedLayers(model)  # Llama-coded decoder layers of few-row CPU steps in joined products
        self.experts = ExpertProducts(model)  # a mixture's fp32 expert products on the measured faster path
        self.choice = StepChoice(model, self.device)  # whether a step runs those five at all (measured per rows)
        self.layer_calls: dict = {}  # what each attention module's calls need, found in the first step (LayerCall)
        self.num_attention_layers = len(spec.kv.stored_layers)  # calls a forward makes (the start-up check's count)
        # decode-only steps padded to a bucket and replayed as CUDA graphs (None: every step eager; see cuda_graphs.py)
        self.graphs = DecodeGraphRunner(self, graphs) if graphs is not None else None
        # whether the model hands its LM head's output back as its logits untouched (None: not seen yet), so that
        # greedy steps may ask the head for picks instead of logits (model/greedy_head.py)
        self.head_gives_logits: bool | None = None
        self.greedy_picks = 0  # steps whose tokens came from the head's picks

    def run(self, plan: StepPlan, sampler: Sampler) -> StepOutcome:
        """Forward pass and sampling for one step (the plan's block moves have run)."""
        started = time.perf_counter()
        inputs = self.prepare(plan)
        fast, trial = self.choice.next(inputs.input_ids.shape[-1] if isinstance(inputs, StepInputs) else None)
        results = self._run(plan, sampler, inputs, fast)
        elapsed = time.perf_counter() - started
        self.choice.record(trial, elapsed)
        return StepOutcome(results, elapsed)

    def _run(self, plan: StepPlan, sampler: Sampler, inputs, fast: bool) -> list[Sampled]:
        greedy = self.greedy_step(plan, inputs) if fast else None
        logits = self.execute(inputs, greedy, fast, keep_dtype=True)
        rows = {batch_index: row for row, batch_index in enumerate(inputs.sampled)}
        index = [rows[source] for source in plan.sample_sources]
        if greedy is not None and greedy.token_ids is not None:  # the head's picks: every request takes its argmax
            picks = greedy.token_ids.tolist()
            self.greedy_picks += 1
            return [Sampled(token=picks[row]) for row in index]
        if index != list(range(len(inputs.sampled))):  # forked samples share their parent's row
            logits = logits[torch.tensor(index, device=logits.device)]
        # bf16 / fp16 logits go to the sampler as they are where every request takes the first maximum (casting
        # moves no maximum; a bf16 Qwen2.5-0.5B-sized head's 64 x 151,936 took 17 ms of a 215 ms step), else float32
        if logits.dtype != torch.float32 and greedy is None and not argmax_only(plan.sampled):
            logits = logits.float()
        return sample_step(sampler, plan.sampled, logits)

    def greedy_step(self, plan: StepPlan, inputs):
        """A request for the LM head's picks (greedy_head.GreedyStep) when every sampled request of the step takes
        its raw logits' argmax with no sampling hook, the head may screen and the model returns the head's output
        as its logits (the first such step checks that, with real logits); else None."""
        if (self.head_gives_logits is False or not plan.sampled or not isinstance(inputs, StepInputs)
                or not self.spec.accepts_logits_to_keep):
            return None
        step = self.linears.greedy_step(self.head_gives_logits is None, len(inputs.sampled))  # cheap checks first
        return step if step is not None and argmax_only(plan.sampled) else None

    def prepare(self, batch: StepPlan) -> StepInputs | PaddedDecode:
        if self.graphs is not None and self.graphs.accepts(batch):
            return self.graphs.prepare(batch)
        bs = self.block_size
        num_groups = max(len(self.spec.kv.kv_groups), 1)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[list[int]] = [[] for _ in range(num_groups)]  # per KV group
        tables: list[list[list[int]]] = [[] for _ in range(num_groups)]
        query_lens, context_lens, sample_rows, sampled = [], [], [], []
        sequences = []  # (first row, rows, state slot, fresh, store): the state layers' view of the packing
        types: list[int] | None = [] if batch.requests[0].token_types is not None else None
        for i, (request, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            start = request.num_computed_tokens
            end = start + n
            checkpoints = batch.checkpoints[i] if batch.checkpoints else ()
            sequences.append((len(input_ids), n, request.state_slot, start == 0, True, checkpoints))
            input_ids.extend(request.all_token_ids[start:end])
            if types is not None:
                types.extend(request.types(start, end))
            positions.extend(request.positions(start, end))
            own = request.block_tables or [[]] * num_groups
            for group, table in enumerate(own):
                slots[group].extend(slots_of(table, start, end, bs))
                tables[group].append(table)
            query_lens.append(n)
            context_lens.append(end)
            if end == request.num_tokens:
                if request.needs_first_query:  # one more sequence: a query over the whole prompt, storing nothing
                    token, position = request.first_query
                    sequences.append((len(input_ids), 1, request.state_slot, False, False, ()))
                    input_ids.append(token)
                    if types is not None:
                        types.append(request.token_types[1])
                    positions.append(position)
                    for group, table in enumerate(own):
                        slots[group].append(NULL_BLOCK * bs)
                        tables[group].append(table)
                    query_lens.append(1)
                    context_lens.append(end)
                sample_rows.append(len(input_ids) - 1)
                sampled.append(i)
        device = self.device
        metadata = [AttentionMetadata.build(query_lens, context_lens, tables[g], slots[g], bs, device)
                    for g in range(num_groups)]
        return StepInputs(
            input_ids=torch.tensor([input_ids], dtype=torch.long, device=device),
            position_ids=torch.tensor([positions], dtype=torch.long, device=device),
            token_type_ids=None if types is None else torch.tensor([types], dtype=torch.long, device=device),
            metadata=metadata[0],
            group_metadata=metadata if num_groups > 1 else None,
            states=None if self.states is None else StateStep.build(self.states, sequences, device, self.checkpoints),
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=device),
            sampled=sampled,
        )

    @torch.inference_mode()
    def execute(self, inputs: StepInputs | PaddedDecode, greedy=None, fast: bool = True,
                keep_dtype: bool = False) -> torch.Tensor | None:
        """Run the model; returns float32 logits [num_sampled, vocab] (LM head only on sampled rows; with `greedy` or
        `keep_dtype`: in the model's dtype), or None when the head gave `greedy` its picks instead. `fast`: with the
        CPU fast paths (`StepChoice`)."""
        require_enabled()  # after hf_paged.disable(), also for replayed graphs: HfPagedDisabled, naming enable()
        if isinstance(inputs, PaddedDecode):
            return self.graphs.run(inputs)
        return self.forward(inputs.input_ids, inputs.position_ids, inputs.metadata, inputs.sample_rows,
                            inputs.token_type_ids, inputs.states, inputs.group_metadata, greedy, fast, keep_dtype)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, metadata: AttentionMetadata,
                sample_rows: torch.Tensor | None, token_type_ids: torch.Tensor | None = None,
                states: StateStep | None = None, group_metadata: list[AttentionMetadata] | None = None,
                greedy=None, fast: bool = True, keep_dtype: bool = False) -> torch.Tensor | None:
        """One packed forward pass: float32 logits of `sample_rows` (None: of every row). The eager path and the
        decode graphs (captured or not) both run exactly this. With `greedy` (`greedy_step`), None when the LM head
        gave its picks (`greedy.token_ids`) instead of logits, else the logits in the model's own dtype (so with
        `keep_dtype`). Not `fast`: without the CPU fast paths (no forward swapped; `StepChoice`)."""
        context = PagedForwardContext(metadata, self.kv_cache, self.backends, states=states,
                                      group_metadata=group_metadata, layer_calls=self.layer_calls)
        kwargs = {}
        if sample_rows is not None and self.spec.accepts_logits_to_keep:
            kwargs["logits_to_keep"] = context.rows_read = sample_rows
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        rows = input_ids.shape[-1]
        head_rows = rows if sample_rows is None or not self.spec.accepts_logits_to_keep else sample_rows.shape[0]
        with forward_lock(self.model), paged_attention_active(self.spec.configs):
            if fast:
                with self.linears.active(rows, head_rows, greedy), self.norms.active(), self.rotary.active(), \
                        self.layers.active(), self.experts.active():
                    out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                     paged_context=context, **kwargs)
            else:
                out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                 paged_context=context, **kwargs)
        if context.num_calls != self.num_attention_layers:
            raise RuntimeError(f"{context.num_calls} attention calls reached the paged KV cache in this step, where "
                               f"the model's {self.num_attention_layers} attention layers each made one when the "
                               f"engine started (a module replaced since, with a config of its own, or code that "
                               f"changed?): the step is undone rather than computed without the cache; build a new "
                               f"engine")
        if greedy is not None and self._head_picked(greedy, out.logits):
            return None
        logits = out.logits[0]
        if sample_rows is not None and not self.spec.accepts_logits_to_keep:
            logits = logits[sample_rows]
        # a greedy step takes each row's first maximum, which casting bf16 / fp16 logits to float32 does not move
        return logits if greedy is not None or keep_dtype else logits.float()

    def _head_picked(self, greedy, logits: torch.Tensor) -> bool:
        """After a forward with `greedy`: whether the head's picks stand for the step's logits. A checking step
        learns whether the model returned the head's output untouched (`head_gives_logits`); a picking step whose
        model returned anything but the head's placeholder (its code changed since the check) is refused: the step
        is undone and later steps compute logits."""
        if greedy.check:
            self.head_gives_logits = returned_untouched(logits, greedy)
            return False
        if greedy.token_ids is None:
            return False
        if logits is not greedy.output:
            self.head_gives_logits = False
            raise HeadOutputChanged("the model changed the output of its LM head after hf_paged checked that it "
                                    "returns it untouched: the step is undone; the engine computes full logits from "
                                    "now on")
        return True


class HeadOutputChanged(RuntimeError):
    """A picking step's model returned something other than its LM head's placeholder (`ModelRunner._head_picked`):
    the step must be undone; the runner no longer asks for picks, so the engine runs it again (`Engine.step`)."""
