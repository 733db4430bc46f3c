"""Decode steps as CUDA graphs: one graph per batch-size bucket, replayed from static buffers.

What is captured
    One whole forward pass of the HF model (every layer's K/V store and paged attention, the LM head over every row)
    for a decode-only step: each scheduled request has exactly one new token. A step of n such requests runs in the
    graph of the smallest bucket >= n (`batch_buckets`: 1, 2, 4, then multiples of 8 up to max_num_seqs, at most
    MAX_GRAPH_BATCH); rows n..bucket-1 are padding and their logits are dropped. Steps with prefills, larger batches,
    contexts past MAX_GRAPH_CONTEXT and backends that cannot be captured run eagerly (`ModelRunner.execute`) exactly as
    without graphs.

Static buffers (`StaticDecodeBatch`)
    What the captured forward reads sits at fixed addresses: one int64 device buffer [input ids | positions | context
    lengths | slots per KV group | tables (max_batch x max_blocks) per KV group], buckets' tensors views into it. Per step the host fills a pinned twin, ONE copy moves the
    used prefix; inside the graph tables and context lengths are cast to int32. Tables are `max_blocks` wide
    (max_model_len, at most MAX_GRAPH_CONTEXT tokens: the pinned context bounds the kernels' temporaries).

Padding never touches a request's KV
    A padding row is token 0 at position 0 with context length 1; its slot is slot 0 of `padding_block` and its table
    row is all `padding_block`: the pool's null block (kv.NULL_BLOCK), which the pool never hands out and which the
    eager path's table padding points at too. Real rows' table entries past their length point at it as well. So
    padding rows write only the null block, and real rows never attend to it (kernels stop at their context length;
    the torch backend masks it, and its values are finite: it starts zeroed and only padding K/V are written there).

Which attention backends are captured (`DecodeGraphRunner.probe`)
    A replay re-runs the kernels recorded at capture with every host-side decision frozen, so the attention code may
    decide nothing on the host from this step's values (no .item(), .tolist(), grid sizes from context lengths). The
    static metadata pins `max_context_len` to max_blocks * block_size, the only host value the capturable backends use:
    * cuda (csrc/ decode kernel): the host passes shapes and max_context_len, which only sizes the partition plan
      (grid z); every thread block reads its sequence's context length and table row on the device, partitions past
      a sequence's length return at once, and the reduce kernel merges just that sequence's partitions. Temporaries
      come from the graph's memory pool; launches go to the current stream. Capturable.
    * triton: the grid is (query tiles + sequences, KV heads, splits), all from shapes, and the split count comes from
      split_count(..., max_context_len), so it is fixed; each program takes its KV range from the device context
      length and splits past it write an empty partial state that the reduce ignores. Capturable; the warm-up run
      compiles the variant for the bucket's shapes.
    * torch: plans dense tiles from Python lists every step (split by length, masks cached per step in a dict) and
      gathers kv_len keys for every decode; pinned to max_model_len it would read the longest context for every row.
      Eager on CUDA. (On CPU it is what the capture=False path runs: the static plan's tensors are refreshed and its
      mask cache cleared on every call.)
    * flash3 / flash2 / flashinfer: per-step host work cached by metadata identity (a step cache keyed by metadata identity: stale with one static
      metadata object), FlashInfer's `plan` (a host-side CSR page list whose length depends on the context lengths),
      FA2's host max_seqlen_k; none of it is pinned here, so they run eagerly.
    The probe asks the runner's backend chooser (made once per engine) which backend a decode step of the model's dtype and head shape gets; cuda and
    triton accept every window / soft-cap, so one probe (no window, no cap) holds for every layer.

Capture
    Lazily, per bucket on its first step (or every bucket, largest first, when the engine starts: cuda_graphs=
    "at_start"): one eager warm-up on a side stream (compiles kernels, loads the extension, settles the allocator), then
    capture on that stream into one memory pool shared by all buckets (one graph runs at a time and its logits are
    consumed within the step). A capture that fails (a forward that syncs, e.g. data-dependent MoE routing) turns
    graphs off with a warning; that step and all later ones run eagerly. transformers' own per-call Python
    (`find_packed_sequence_indices` syncs on the position ids) skips its check while a stream is capturing, and the
    "paged" mask function returns None whatever it is given. An fp8 cache's per-layer scales are Python floats the
    engine fixes when it starts (model/kv_calibration.py), before any capture: graphs bake in their final values.

`capture=False` runs the very same padded static-buffer path with the replay replaced by a plain call of the same
forward: that is how the tests exercise all of the above on CPU.
"""
from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..attention import AttentionMetadata, DenseTile, dispatch
from ..config import EngineConfig, logger
from ..kv import NULL_BLOCK
from ..kv.slots import slot_of

MAX_GRAPH_BATCH = 512  # larger decode batches are compute-bound enough that launches do not matter: eager
# longest context a graph serves (longer decode steps run eagerly): it sizes every graph's block tables and, through the
# pinned max_context_len, the CUDA kernel's partition count / Triton's split count and their temporaries
MAX_GRAPH_CONTEXT = 8192


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Padded batch sizes: 1, 2, 4, then multiples of 8, ending with min(max_num_seqs, MAX_GRAPH_BATCH) itself."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    return tuple([s for s in (1, 2, 4) if s < top] + list(range(8, top, 8)) + [top])


def bucket_for(num_seqs: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds `num_seqs` rows, or None when the largest is too small."""
    i = bisect.bisect_left(buckets, num_seqs)
    return buckets[i] if i < len(buckets) else None


@dataclass(slots=True)
class DecodeGraphSettings:
    """Shape of the decode graphs. Invariant: `padding_block` is a block of the KV storage the pool never hands out
    (the null block; tests aim it elsewhere to show that padding would then write a real block).
    Graphs serve contexts of up to max_blocks * block_size tokens (all of max_model_len when it is at most
    MAX_GRAPH_CONTEXT); a step with a longer one runs eagerly."""

    max_batch: int
    max_blocks: int
    capture: bool = True  # False: the same padded path, each replay replaced by a plain call (CPU tests)
    capture_at_start: bool = False
    padding_block: int = NULL_BLOCK

    @classmethod
    def for_engine(cls, config: EngineConfig, device: torch.device, num_pool_blocks: int,
                   max_model_len: int | None) -> "DecodeGraphSettings | None":
        """Settings for an engine, or None where decode graphs are off (not a CUDA device, or cuda_graphs=False)."""
        if config.cuda_graphs is False or torch.device(device).type != "cuda":
            return None
        return cls.build(config, num_pool_blocks, max_model_len, capture=True)

    @classmethod
    def build(cls, config: EngineConfig, num_pool_blocks: int, max_model_len: int | None,
              capture: bool) -> "DecodeGraphSettings":
        # a table never holds more blocks than the pool, nor more than max_model_len needs
        per_sequence = min(num_pool_blocks, -(-MAX_GRAPH_CONTEXT // config.block_size))
        if max_model_len is not None:
            per_sequence = min(per_sequence, -(-max_model_len // config.block_size))
        return cls(max_batch=min(config.max_num_seqs, MAX_GRAPH_BATCH), max_blocks=per_sequence,
                   capture=capture, capture_at_start=config.cuda_graphs == "at_start")


@dataclass(slots=True)
class StaticDecodeBatch:
    """One bucket's inputs at fixed addresses (views of the runner's device staging buffer) and the metadata built on
    them. `tables` / `context_lens` are int64 staging views (the torch backend's decode plan reads them directly);
    `metadata.block_tables` / `metadata.context_lens` are their int32 copies, refreshed inside the graph."""

    size: int
    input_ids: torch.Tensor  # [1, size]
    position_ids: torch.Tensor  # [1, size]
    context_lens: torch.Tensor  # [size] int64
    tables: torch.Tensor  # [size, max_blocks] int64 (the first KV group's)
    metadata: AttentionMetadata  # the first KV group's
    group_tables: list = field(default_factory=list)  # every KV group's tables and metadata, in group order
    group_metadata: list = field(default_factory=list)
    logits: torch.Tensor | None = None  # float32 [size, vocab] of the last run: a graph's static output


@dataclass(slots=True)
class PaddedDecode:
    """A decode-only step staged in bucket `size`: rows 0..num_seqs-1 are the batch's requests in order."""

    size: int
    num_seqs: int
    sample_rows: torch.Tensor | None  # the rows whose logits are returned; None: all num_seqs rows
    sampled: list[int] = field(default_factory=list)  # index into the batch of each request that samples


class DecodeGraphRunner:
    """Runs decode-only steps padded to a bucket from static buffers: one CUDA graph per bucket, or (capture=False)
    a plain call of the same forward.

    `runner` is the ModelRunner (its `forward`, `device`, `block_size`, `backend`, `kv_cache`, `model`).
    Invariants: the staging buffers never move (graphs hold their addresses); row i of the host block tables holds
    real entries in its first `_row_extent[i]` columns and `padding_block` everywhere else.
    """

    def __init__(self, runner, settings: DecodeGraphSettings):
        if settings.capture and runner.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {runner.device}; capture=False runs the padded "
                             "path eagerly")
        self.runner = runner
        self.settings = settings
        self.buckets = batch_buckets(settings.max_batch)
        rows, width = self.buckets[-1], settings.max_blocks
        device = runner.device
        self.num_groups = groups = max(len(runner.kv_cache.spec.kv_groups), 1)  # KV groups: a table and slots each
        # [ids | positions | context lengths | slots of each group] x rows, then each group's tables: rows x width
        self.host = torch.zeros(rows * (3 + groups + groups * width), dtype=torch.int64,
                                pin_memory=device.type == "cuda")
        self.host_view = self.host.numpy()
        self.host_view[self._tables_at(0):] = settings.padding_block
        self.staging = self.host.to(device, copy=True)
        self._row_extent = [[0] * rows for _ in range(groups)]
        self._arange = torch.arange(rows + 1, dtype=torch.int64, device=device)
        self._ones = torch.ones(rows, dtype=torch.int64, device=device)
        self._valid = torch.ones(rows, dtype=torch.bool, device=device)
        self._query_start = torch.zeros(rows, dtype=torch.int64, device=device)
        self._cu32 = self._arange.to(torch.int32)
        self._context32 = torch.ones(rows, dtype=torch.int32, device=device)
        self._tables32 = [torch.full((rows * width,), settings.padding_block, dtype=torch.int32, device=device)
                          for _ in range(groups)]
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self.batches: dict[int, StaticDecodeBatch] = {}
        self.captured: dict = {}  # bucket -> torch.cuda.CUDAGraph
        self.pool = None
        self.stream = None
        self.off_reason: str | None = None  # why decode steps run eagerly (None: they take this path)
        self.probed = not settings.capture
        self.steps_per_bucket: Counter = Counter()
        if settings.capture_at_start:
            self.capture_all()

    # ---- which steps ------------------------------------------------------------------------------------------
    def accepts(self, batch) -> bool:
        """Whether this scheduled step takes the padded path: decode-only, fits the largest bucket, every context fits
        the tables, graphs not off."""
        if not batch.requests or len(batch.requests) > self.buckets[-1] or any(n != 1 for n in batch.num_new_tokens):
            return False
        if any(request.needs_first_query or request.token_types is not None for request in batch.requests):
            return False  # an extra query row, or token type ids: eager steps
        limit = self.settings.max_blocks * self.runner.block_size
        if any(request.num_computed_tokens >= limit for request in batch.requests) or not self._scales_fixed():
            return False
        return self.probe() is None

    def _scales_fixed(self) -> bool:
        """Whether an fp8 cache's scales are set (the engine fixes them at start, before any capture): a graph bakes
        in their values."""
        return None not in self.runner.kv_cache.kv_scales

    def probe(self) -> str | None:
        """None when decode steps here run on a capturable backend, else why they run eagerly (decided once)."""
        if not self.probed:
            self.probed = True
            self.off_reason = self._backend_reason()
            if self.off_reason is not None:
                logger.info("hf_paged: decode steps run without CUDA graphs: %s", self.off_reason)
        return self.off_reason

    def _backend_reason(self) -> str | None:
        model, cache = self.runner.model, self.runner.kv_cache
        text = model.config.get_text_config(decoder=True)
        query = torch.empty(1, text.num_attention_heads, cache.spec.head_dim,
                            dtype=next(model.parameters()).dtype, device=self.runner.device)
        try:
            keys = next(k for k in cache.key_caches if k is not None)
            backend = self.runner.backends.backend_for(query, keys, self._batch(1).metadata, None, None)
        except Exception as e:  # noqa: BLE001 - the reason is reported, the step runs eagerly
            return f"no attention backend for a decode step: {e}"
        if not backend.graph_capturable:
            return f"decode steps use the {backend.name!r} attention backend, which is not captured in CUDA graphs"
        return None

    # ---- one step ---------------------------------------------------------------------------------------------
    def prepare(self, batch) -> PaddedDecode:
        """Stage a decode-only step (accepts(batch) is True) in the smallest bucket that holds it."""
        size = bucket_for(len(batch.requests), self.buckets)
        sampled = self._stage(batch.requests, size)
        rows = None
        if len(sampled) != len(batch.requests):
            rows = torch.tensor(sampled, dtype=torch.long, device=self.runner.device)
        return PaddedDecode(size, len(batch.requests), rows, sampled)

    def run(self, step: PaddedDecode) -> torch.Tensor:
        """float32 logits [len(step.sampled), vocab]: replay (capturing on first use), or a plain call."""
        batch = self._batch(step.size)
        graph = self.captured.get(step.size)
        if graph is None and self.settings.capture and self.off_reason is None:
            graph = self._capture(batch)
        if graph is not None:
            graph.replay()
        else:  # capture=False, or the capture just failed: the same padded inputs, eagerly
            self._forward(batch)
        self.steps_per_bucket[step.size] += 1
        if step.sample_rows is None:
            return batch.logits[: step.num_seqs].clone()  # a copy: the next replay overwrites the static output
        return batch.logits[step.sample_rows]

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket now, largest first (smaller graphs then reuse the shared pool), on padding rows only."""
        if not self.settings.capture or self.probe() is not None or not self._scales_fixed():
            return  # (an fp8 cache whose scales are not set yet: the engine captures again once it has set them)
        for size in reversed(self.buckets):
            if size not in self.captured:
                self._stage([], size)
                if self._capture(self._batch(size)) is None:
                    return

    # ---- internals --------------------------------------------------------------------------------------------
    def _slots_at(self, group: int) -> int:
        """Offset of a group's slots in the staging buffer."""
        return (3 + group) * self.buckets[-1]

    def _tables_at(self, group: int) -> int:
        """Offset of a group's block tables in the staging buffer."""
        rows = self.buckets[-1]
        return (3 + self.num_groups + group * self.settings.max_blocks) * rows

    def _stage(self, requests: list, size: int) -> list[int]:
        """Write the step into the pinned host buffer (padding rows after the requests) and start one copy of the
        used prefix to the device. Returns the index of each request that samples (its token is its last)."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the host buffer
        rows, width, bs = self.buckets[-1], self.settings.max_blocks, self.runner.block_size
        padding = self.settings.padding_block
        host = self.host_view
        ids, positions, contexts = (host[k * rows:(k + 1) * rows] for k in range(3))
        sampled = []
        for i, request in enumerate(requests):
            pos = request.num_computed_tokens
            ids[i] = request.all_token_ids[pos]
            positions[i] = pos + request.position_shift if pos >= request.num_prompt_tokens else pos
            contexts[i] = pos + 1
            if pos + 1 == request.num_tokens:
                sampled.append(i)
        n = len(requests)
        ids[n:size] = 0
        positions[n:size] = 0
        contexts[n:size] = 1
        for group in range(self.num_groups):
            slots = host[self._slots_at(group):self._slots_at(group) + rows]
            tables = host[self._tables_at(group):self._tables_at(group) + rows * width].reshape(rows, width)
            extent = self._row_extent[group]
            for i, request in enumerate(requests):
                pos = request.num_computed_tokens
                table = request.block_tables[group]
                used = pos // bs + 1
                slots[i] = slot_of(table, pos, bs)
                tables[i, :used] = table[:used]
                if extent[i] > used:
                    tables[i, used:extent[i]] = padding
                extent[i] = used
            slots[n:size] = padding * bs
            for i in range(n, size):
                if extent[i]:
                    tables[i, :extent[i]] = padding
                    extent[i] = 0
        end = self._tables_at(self.num_groups - 1) + size * width
        self.staging[:end].copy_(self.host[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return sampled

    def _batch(self, size: int) -> StaticDecodeBatch:
        """The static views and metadata of one bucket (built once)."""
        batch = self.batches.get(size)
        if batch is not None:
            return batch
        rows, width, bs = self.buckets[-1], self.settings.max_blocks, self.runner.block_size
        staging = self.staging
        context_lens = staging[2 * rows:2 * rows + size]
        arange = self._arange[:size]
        group_tables, group_metadata = [], []
        for group in range(self.num_groups):
            tables = staging[self._tables_at(group):self._tables_at(group) + size * width].view(size, width)
            plan = DenseTile(  # the torch backend's view of the step: one decode group, every row a sequence
                query_index=arange.view(size, 1), valid=self._valid[:size], rows=arange, block_tables=tables,
                flat_tables=tables.view(-1), query_start=self._query_start[:size].view(size, 1),
                query_lens=self._ones[:size].view(size, 1), context_lens=context_lens.view(size, 1),
                max_query_len=1, kv_len=width * bs)
            group_tables.append(tables)
            group_metadata.append(AttentionMetadata(
                cu_seqlens_q=self._cu32[:size + 1], context_lens=self._context32[:size],
                block_tables=self._tables32[group][:size * width].view(size, width),
                slot_mapping=staging[self._slots_at(group):self._slots_at(group) + size],
                max_query_len=1, max_context_len=width * bs, block_size=bs, tiles=[plan], num_decode_tiles=1))
        batch = StaticDecodeBatch(size, staging[:size].view(1, size), staging[rows:rows + size].view(1, size),
                                  context_lens, group_tables[0], group_metadata[0],
                                  group_tables=group_tables, group_metadata=group_metadata)
        self.batches[size] = batch
        return batch

    def _forward(self, batch: StaticDecodeBatch) -> None:
        """What a graph holds: refresh the derived metadata from the staging views, run the model on every row."""
        metadata = batch.metadata
        for tables, group in zip(batch.group_tables, batch.group_metadata):
            group.block_tables.copy_(tables)
            group.tiles[0].allowed.clear()  # masks are cached per step; a static plan rebuilds them from the tensors
        metadata.context_lens.copy_(batch.context_lens)  # shared by every group's metadata
        plan = metadata.tiles[0]
        torch.sub(plan.context_lens, 1, out=plan.query_start)  # shared too
        batch.logits = self.runner.forward(batch.input_ids, batch.position_ids, metadata, None,
                                           group_metadata=batch.group_metadata if self.num_groups > 1 else None)

    def _capture(self, batch: StaticDecodeBatch):
        """Warm up and capture the bucket's graph (the staged step is not yet computed: the caller replays). None,
        and graphs off for good, when capturing fails."""
        device = self.runner.device
        try:
            if self.stream is None:
                self.stream = torch.cuda.Stream(device)
                self.pool = torch.cuda.graph_pool_handle()
            self.stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self.stream):
                self._forward(batch)  # warm-up: compiles / loads kernels outside the capture
            torch.cuda.current_stream(device).wait_stream(self.stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                self._forward(batch)
        except Exception as e:  # noqa: BLE001 - e.g. a model whose forward syncs: it simply runs eagerly
            self.off_reason = f"capturing the decode graph of batch size {batch.size} failed: {type(e).__name__}: {e}"
            logger.warning("hf_paged: CUDA graphs turned off, decode steps run eagerly: %s", self.off_reason)
            return None
        self.captured[batch.size] = graph
        return graph

    def forget(self) -> None:
        """Drop the captured graphs and their pool (they hold the KV cache's addresses); buckets capture again."""
        self.captured.clear()
        self.pool = self.stream = None

    def stats(self) -> dict:
        return {"graph_buckets": self.buckets, "graphs_captured": sorted(self.captured),
                "padded_steps_per_bucket": dict(sorted(self.steps_per_bucket.items())), "graphs_off": self.off_reason}


__all__ = ["DecodeGraphRunner", "DecodeGraphSettings", "PaddedDecode", "StaticDecodeBatch", "batch_buckets",
           "bucket_for", "MAX_GRAPH_BATCH", "MAX_GRAPH_CONTEXT"]
