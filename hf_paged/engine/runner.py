"""Packs one scheduled step into a single varlen forward pass of the HF model."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import AttentionMetadata
from .cuda_graphs import DecodeGraphRunner, DecodeGraphSettings, PaddedDecode
from ..model import PagedForwardContext, paged_attention_active
from ..model import ModelSpec
from ..kv import KVCache
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

    def __init__(self, model: torch.nn.Module, spec: ModelSpec, kv_cache: KVCache, backend: str = "torch",
                 graphs: DecodeGraphSettings | None = None):
        self.model = model
        self.spec = spec
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = spec.kv.device
        self.block_size = kv_cache.block_size
        self._initialized = bytearray(kv_cache.num_blocks)  # 1 = the block holds finite values
        # padding entries of block tables point at block 0; keep its contents finite from the start
        self.zero_blocks([0])
        # decode-only steps padded to a bucket and replayed as CUDA graphs (None: every step eager; see cuda_graphs.py)
        self.graphs = DecodeGraphRunner(self, graphs) if graphs is not None else None

    def zero_blocks(self, block_ids: list[int]) -> None:
        """Blocks never used before may hold garbage (the storage is torch.empty) and masked positions must
        never be NaN. Once zeroed, a block only ever receives finite K/V (writes, swap-ins, copies), so each
        block is cleared at most once in the cache's life."""
        todo = [b for b in block_ids if not self._initialized[b]]
        if not todo:
            return
        for b in todo:
            self._initialized[b] = 1
        storage = self.kv_cache.storage
        if len(todo) <= 8:  # a few strided views beat one advanced-index write
            for b in todo:
                storage[:, :, b].zero_()
        else:
            storage[:, :, torch.tensor(todo, device=self.device)] = 0

    def forget_blocks(self, block_ids: list[int]) -> None:
        """These blocks may hold non-finite K/V (their request's forward pass went wrong): clear them again
        the next time they are handed out."""
        for b in block_ids:
            self._initialized[b] = 0

    def prepare(self, batch: ScheduledBatch) -> StepInputs | PaddedDecode:
        if self.graphs is not None and self.graphs.accepts(batch):
            return self.graphs.prepare(batch)
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
    def execute(self, inputs: StepInputs | PaddedDecode) -> torch.Tensor:
        """Run the model; returns float32 logits [num_sampled, vocab] (LM head only on sampled rows)."""
        if isinstance(inputs, PaddedDecode):
            return self.graphs.run(inputs)
        return self.forward(inputs.input_ids, inputs.position_ids, inputs.metadata, inputs.sample_rows)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, metadata: AttentionMetadata,
                sample_rows: torch.Tensor | None) -> torch.Tensor:
        """One packed forward pass: float32 logits of `sample_rows` (None: of every row). The eager path and the
        decode graphs (captured or not) both run exactly this."""
        context = PagedForwardContext(metadata, self.kv_cache, self.backend)
        kwargs = {}
        if sample_rows is not None and self.spec.accepts_logits_to_keep:
            kwargs["logits_to_keep"] = sample_rows
        with paged_attention_active(self.spec.configs):
            out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                             paged_context=context, **kwargs)
        logits = out.logits[0]
        if sample_rows is not None and not self.spec.accepts_logits_to_keep:
            logits = logits[sample_rows]
        return logits.float()
