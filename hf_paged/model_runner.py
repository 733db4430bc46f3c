"""Packs one scheduled step into a single varlen forward pass of the HF model."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import AttentionMetadata
from .integrations.hf_attention import PagedForwardContext, paged_attention_active
from .integrations.model_spec import ModelSpec
from .kv import KVCache
from .scheduler import ScheduledBatch


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    metadata: AttentionMetadata
    sample_rows: torch.Tensor  # packed row of each sampled request's last token
    sampled: list[int]  # index into the batch of each request that samples this step


class ModelRunner:
    """Owns the KV tensors; turns a `ScheduledBatch` into logits for the requests that sample this step."""

    def __init__(self, model: torch.nn.Module, spec: ModelSpec, kv_cache: KVCache, backend: str = "torch"):
        self.model = model
        self.spec = spec
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = spec.kv.device
        self.block_size = kv_cache.block_size
        # padding entries of block tables point at block 0; keep its contents finite from the start
        self.zero_blocks([0])

    def zero_blocks(self, block_ids: list[int]) -> None:
        """Freshly handed-out blocks may hold garbage (torch.empty); masked positions must never be NaN."""
        if block_ids:
            self.kv_cache.storage[:, :, torch.tensor(block_ids, device=self.device)] = 0

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, context_lens, tables, sample_rows, sampled = [], [], [], [], []
        for i, (request, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            start = request.num_computed_tokens
            end = start + n
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            table = request.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(n)
            context_lens.append(end)
            tables.append(table)
            if end == request.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                sampled.append(i)
        device = self.device
        metadata = AttentionMetadata.build(query_lens, context_lens, tables, slots, bs, device)
        return StepInputs(
            input_ids=torch.tensor([input_ids], dtype=torch.long, device=device),
            position_ids=torch.tensor([positions], dtype=torch.long, device=device),
            metadata=metadata,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=device),
            sampled=sampled,
        )

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Run the model; returns float32 logits [num_sampled, vocab] (LM head only on sampled rows)."""
        context = PagedForwardContext(inputs.metadata, self.kv_cache, self.backend)
        kwargs = {}
        if self.spec.accepts_logits_to_keep:
            kwargs["logits_to_keep"] = inputs.sample_rows
        with paged_attention_active(self.spec.configs):
            out = self.model(input_ids=inputs.input_ids, position_ids=inputs.position_ids, use_cache=False,
                             paged_context=context, **kwargs)
        logits = out.logits[0]
        if not self.spec.accepts_logits_to_keep:
            logits = logits[inputs.sample_rows]
        return logits.float()
