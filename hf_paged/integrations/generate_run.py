"""One `generate(cache_implementation="paged")` call executed on the engine, with HF's exact semantics:
HF's own logits processors and stopping criteria, streamer columns, padding and the same return types."""
from __future__ import annotations

import torch

from ..config import EngineConfig
from ..engine import Engine
from ..kv import blocks_needed
from ..request import Request
from ..sampling import SamplingParams
from ..model.own_state import has_own_state
from .returned_cache import KVSnapshots

_NATIVE_CRITERIA = ("MaxLengthCriteria", "EosTokenCriteria")
_SCORE_BLIND_CRITERIA = (*_NATIVE_CRITERIA, "StopStringCriteria", "MaxTimeCriteria")
# HF's processors whose result for a row depends only on that row's ids and scores, never on how often or with which
# other rows they were called: rows may run them out of step (in groups), and a finished row's scores never matter
_ROW_WISE_PROCESSORS = frozenset((
    "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor", "TemperatureLogitsWarper",
    "RepetitionPenaltyLogitsProcessor", "TopPLogitsWarper", "TopKLogitsWarper", "TopHLogitsWarper", "MinPLogitsWarper",
    "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper", "NoRepeatNGramLogitsProcessor",
    "SequenceBiasLogitsProcessor", "NoBadWordsLogitsProcessor", "ForcedBOSTokenLogitsProcessor",
    "ForcedEOSTokenLogitsProcessor", "InfNanRemoveLogitsProcessor", "ExponentialDecayLengthPenalty",
    "LogitNormalization", "SuppressTokensAtBeginLogitsProcessor", "SuppressTokensLogitsProcessor"))


def _row_wise(processor) -> bool:
    return type(processor).__module__ == "transformers.generation.logits_process" and \
        type(processor).__name__ in _ROW_WISE_PROCESSORS


class GenerateRun:
    """Sampling controller for the rows of one generate call (the engine's `controller` protocol:
    `process(requests, logits) -> [(token, stop_now)]`).

    HF's processors and criteria see exactly the `input_ids` its own loop would hold: every row as passed
    in (padding kept) followed by the tokens generated so far, the whole batch in its order. As in HF, rows that
    stop are padded only when an EOS criterion exists; otherwise every row keeps generating until the
    last one stops (`self.length`, the common final length). When scores or logits are returned, or a processor may
    read other rows (not one of HF's row-wise ones), stopped rows also run on (on their pads) until the last one
    stops, so that their scores are HF's. An exception raised by a processor or a criterion ends the call and reaches
    the caller unchanged.

    Lockstep (`self.lockstep`, whenever the engine can hold every row at once: `lockstep_blocker`): HF calls the
    processors and criteria once per step with every row, and samples the whole batch with one `torch.multinomial`.
    The scheduler asks `holds_back` before a row samples: its last token waits until every unfinished row of the call
    samples in the same engine step, so each HF step is one `process` call with every row at the same length. Without
    it rows sample in groups of equal length, which is exact only for greedy search with row-wise processors
    (`must_lockstep`: otherwise generate runs HF's own loop).
    """

    def __init__(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, generation_config,
                 logits_processor, stopping_criteria, streamer, position_ids: torch.Tensor | None = None,
                 token_type_ids: torch.Tensor | None = None):
        self.model = model
        self.input_ids = input_ids
        self.mask = attention_mask
        self.rows = input_ids.tolist()
        mask = attention_mask.tolist() if attention_mask is not None else None
        # the real tokens of each row (padding removed); positions restart at 0 like HF's
        self.prompts = [[t for t, m in zip(row, mask[b]) if m] if mask is not None else list(row)
                        for b, row in enumerate(self.rows)]
        self.first_queries = self._first_queries(mask, position_ids)
        # token types of each row's real tokens, and the one HF gives every new token (its last column's)
        types = token_type_ids.tolist() if token_type_ids is not None else None
        self.token_types = [None if types is None else
                            ([t for t, m in zip(types[b], mask[b]) if m] if mask is not None else types[b], types[b][-1])
                            for b in range(len(self.rows))]
        self.config = generation_config
        self.logits_processor = logits_processor
        self.stopping_criteria = stopping_criteria
        self.streamer = streamer
        self.do_sample = bool(generation_config.do_sample)
        self.want_scores = bool(generation_config.return_dict_in_generate and generation_config.output_scores)
        self.want_logits = bool(generation_config.return_dict_in_generate and generation_config.output_logits)
        pad = generation_config._pad_token_tensor
        eos = generation_config._eos_token_tensor
        eos = [] if eos is None else [int(t) for t in eos.reshape(-1).tolist()]
        self.pad = int(pad) if pad is not None else (eos[0] if eos else 0)
        self.eos = [t for t in eos if t >= 0]  # HF takes -1 for "no EOS": it matches no token
        self.max_new_tokens = max(1, generation_config.max_length - input_ids.shape[1])
        self.scores: list[list[torch.Tensor]] = [[] for _ in self.rows]
        self.raw_logits: list[list[torch.Tensor]] = [[] for _ in self.rows]
        self.pads_finished = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
        row_wise = all(_row_wise(p) for p in logits_processor)
        # rows end when they stop, unless HF keeps computing them: without an EOS criterion (no padding), when
        # scores / logits or the cache are returned (HF returns those of finished rows too, computed from their pads),
        # or when a processor may read the scores of finished rows (HF hands it those computed from their pads)
        returns_cache = bool(generation_config.return_dict_in_generate and generation_config.use_cache is not False)
        self.finish_at_stop = self.pads_finished and row_wise and not (self.want_scores or self.want_logits
                                                                       or returns_cache)
        # HF's results depend on every HF step being one call with all rows: sampling draws for the whole batch at
        # once, and a processor other than HF's row-wise ones may count calls or read the other rows
        self.must_lockstep = self.do_sample or not row_wise
        self.lockstep = False  # set by `run`
        self.stopped: dict[int, int] = {}  # row -> output count when it first stopped (no-EOS mode)
        self.length: int | None = None
        self.error: Exception | None = None
        self.requests: list[Request] = []
        self.streamed = 0
        self.snapshots: KVSnapshots | None = None
        self.block_size = 16

    def _first_queries(self, mask, position_ids) -> list[tuple[int, int] | None]:
        """Rows ending with padding (right padding): HF samples their first token from the last pad, at the position
        HF gave it, attending to the real tokens only; later tokens continue from that position."""
        queries = []
        for b, row in enumerate(self.rows):
            if mask is None or mask[b][-1]:
                queries.append(None)
                continue
            if position_ids is None:
                raise ValueError("hf_paged generate: a right-padded row needs HF's position_ids")
            queries.append((row[-1], int(position_ids[b, -1])))
        return queries

    @property
    def native(self) -> bool:
        """True when the engine's own greedy sampler gives HF's result (no processors, only length / EOS stops, rows
        that end at their EOS)."""
        return (not self.do_sample and len(self.logits_processor) == 0 and not self.want_scores
                and not self.want_logits and (self.finish_at_stop or not self.pads_finished)
                and all(type(c).__name__ in _NATIVE_CRITERIA for c in self.stopping_criteria))

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_new_tokens, temperature=0.0, ignore_eos=True,
                              stop_token_ids=list(self.eos) if self.native else [])

    def engine_config(self, options: dict | None) -> EngineConfig:
        """The caller's cache_config. Without a pool size: exactly what this batch needs, so nothing is ever
        preempted, and the engine lives for this one call: no swap space (nor its bandwidth probe), no CUDA graphs
        to capture, unless the caller asks for them. With a sampling hook, and limits the caller did not set: every
        row runs at once (for lockstep)."""
        options = dict(options or {})
        config = EngineConfig.from_dict(options)
        if config.num_blocks is None and config.kv_cache_memory is None:
            config = config.replace(num_blocks=self._blocks_needed(config.block_size),
                                    preemption_mode=options.get("preemption_mode", "recompute"),
                                    cuda_graphs=options.get("cuda_graphs", False))
        if not self.native:
            config = config.replace(**{name: max(getattr(config, name), len(self.rows))
                                       for name in ("max_num_seqs", "max_num_batched_tokens") if name not in options})
        return config

    def _blocks_needed(self, block_size: int) -> int:
        return sum(blocks_needed(len(p) + self.max_new_tokens, block_size) for p in self.prompts)

    def lockstep_blocker(self, engine: Engine) -> str | None:
        """Why the rows cannot all sample each HF step in one engine step (None: they can): every row must run at once
        (max_num_seqs), each needs a token in that step (max_num_batched_tokens), and the pool must hold every row at
        its full length, so that no row is ever preempted (it would fall behind the others)."""
        rows, config = len(self.rows), engine.config
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(config, name) < rows:
                return f"{rows} rows with {name}={getattr(config, name)}"
        need = self._blocks_needed(config.block_size)
        if engine.memory.num_blocks < need:
            return f"a KV pool of {engine.memory.num_blocks} blocks, for rows that need up to {need}"
        return None

    def holds_back(self, requests: list[Request]) -> bool:
        """Asked by the scheduler about the rows that would sample in the next engine step: in lockstep, whether they
        must wait (some unfinished row of the call would not sample with them)."""
        if not self.lockstep:
            return False
        sampling = {id(r) for r in requests}
        sampling.update(id(c) for r in requests if r.num_output_tokens == 0 for c in r.forks)  # they sample with it
        return any(id(r) not in sampling for r in self.requests if not r.is_finished)

    # ---- controller protocol ------------------------------------------------------------------------
    def _batch_ids(self, length: int) -> list[list[int]]:
        """Every row as HF's `input_ids` holds it at `length`: the row as passed in, then its new tokens, then
        pads once it finished (rows at another length are cut or padded; their results are not used)."""
        out = []
        for row, request in zip(self.rows, self.requests):
            history = (row + request.output_token_ids)[:length]
            out.append(history + [self.pad] * (length - len(history)))
        return out

    def process(self, requests: list[Request], logits: torch.Tensor) -> list[tuple[int, bool]]:
        try:
            return self._process(requests, logits)
        except Exception as e:  # HF would raise it from `generate`: `run` re-raises it
            self.error = e
            raise

    def _process(self, requests: list[Request], logits: torch.Tensor) -> list[tuple[int, bool]]:
        """Processors, sampling and criteria always see the whole batch in its original order, as in HF's loop
        (processors may hold per-row state); rows not sampled at this length get zero logits, and pads."""
        picks: list[tuple[int, bool] | None] = [None] * len(requests)
        by_length: dict[int, list[int]] = {}
        for i, request in enumerate(requests):
            by_length.setdefault(len(self.rows[request.index]) + request.num_output_tokens, []).append(i)
        if self.lockstep and len(by_length) > 1:
            raise RuntimeError("hf_paged generate: rows out of step in lockstep")
        device = self.input_ids.device  # where HF's loop processes and samples (input_ids may stay on the CPU)
        logits = logits.to(device)
        for length, members in by_length.items():
            rows = torch.tensor([requests[i].index for i in members], device=device)
            ids = torch.tensor(self._batch_ids(length), dtype=torch.long, device=device)
            raw = logits.new_zeros(len(self.rows), logits.shape[-1])
            raw[rows] = logits[torch.tensor(members, device=device)]
            # the very tensor HF keeps as this step's logits: a processor editing it in place edits those too
            scores = self.logits_processor(ids, raw)
            if self.do_sample:
                probs = torch.ones_like(scores)  # other rows: uniform, so sampling draws for every row like HF
                probs[rows] = torch.softmax(scores[rows], dim=-1)
                tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
            else:
                tokens = scores.argmax(dim=-1)
            chosen = torch.full_like(tokens, self.pad)
            chosen[rows] = tokens[rows]
            if self.pads_finished and self.stopped:  # rows that stopped earlier get pads, as HF gives them
                chosen[torch.tensor(list(self.stopped), device=device)] = self.pad
            for row in rows.tolist():
                if self.want_scores:
                    self.scores[row].append(scores[row])
                if self.want_logits:
                    self.raw_logits[row].append(raw[row])
            steps = length + 1 - self.input_ids.shape[1]
            stop = self.stopping_criteria(torch.cat([ids, chosen[:, None]], dim=-1), self._scores_so_far(steps))
            counts = {requests[i].index: requests[i].num_output_tokens + 1 for i in members}
            if not self.finish_at_stop:
                self._note_stops(counts, stop)
            for i in members:
                row = requests[i].index
                done = bool(stop[row]) if self.finish_at_stop else self.length is not None and counts[row] >= self.length
                picks[i] = (int(chosen[row]), done)
        return picks

    def _scores_so_far(self, steps: int):
        """What HF hands stopping criteria as `scores`: None unless scores are collected, else the tuple so far
        (built only for criteria that may read it)."""
        if not self.want_scores or all(type(c).__name__ in _SCORE_BLIND_CRITERIA for c in self.stopping_criteria):
            return None
        return self._stack(self.scores, steps)

    def _note_stops(self, counts: dict[int, int], stop: torch.Tensor) -> None:
        """Rows that stop keep running until the last one stops, whose count becomes everyone's final length
        (without an EOS criterion HF pads nothing; with one, stopped rows run on their pads)."""
        for row, count in counts.items():
            if stop[row]:
                self.stopped.setdefault(row, count)
        if self.length is None and len(self.stopped) == len(self.rows):
            self.length = max(self.stopped.values())

    # ---- streaming and results --------------------------------------------------------------------
    def _column(self, step: int) -> list[int]:
        return [r.output_token_ids[step] if step < r.num_output_tokens else self.pad for r in self.requests]

    def stream_ready(self) -> None:
        """Hand the streamer every step column that all rows have produced (finished rows give pad)."""
        if self.streamer is None:
            return
        while True:
            step = self.streamed
            if self.length is not None and step >= self.length:
                return
            if not all(r.num_output_tokens > step or r.is_finished for r in self.requests):
                return
            if all(r.num_output_tokens <= step for r in self.requests):
                return
            self.streamer.put(torch.tensor(self._column(step), dtype=torch.long))
            self.streamed += 1

    def run(self, engine: Engine) -> None:
        # the returned cache (not when the engine stores K/V by attention call, HF's cache by the calling layer's
        # index: a shared attention block, several calls per layer; nor when state modules keep their state on
        # themselves or in a passed argument, where no cache of HF's holds it: own_state; the caller then gets no
        # cache and a continuation recomputes)
        if self.config.return_dict_in_generate and self.config.use_cache is not False \
                and not engine.spec.kv.by_call and not has_own_state(self.model):
            self.snapshots = KVSnapshots(engine.memory.cache, engine.scheduler.kv.states)  # the returned cache: rows' K/V kept as they finish
            self.block_size = engine.config.block_size
            engine.scheduler.release_hooks.append(self.snapshots.keep)
        params = self.sampling_params()
        controller = None if self.native else self
        self.lockstep = controller is not None and self.lockstep_blocker(engine) is None
        keys = [(tuple(p), q, repr(t)) for p, q, t in zip(self.prompts, self.first_queries, self.token_types)]
        for b, prompt in enumerate(self.prompts):
            # num_return_sequences copies of a row fork from its first copy: the prompt is computed once
            first = self.requests[-1] if b and keys[b] == keys[b - 1] else None
            while first is not None and first.index > 0 and keys[first.index - 1] == keys[b]:
                first = self.requests[first.index - 1]
            self.requests += engine.add_request(prompt, params, index=b, controller=controller, fork_of=first,
                                                first_query=self.first_queries[b],
                                                token_types=self.token_types[b]).samples
        while engine.has_unfinished and self.error is None:
            engine.step()
            self.stream_ready()
        if self.error is not None:
            raise self.error
        failed = [r for r in self.requests if r.finish_reason == "error"]
        if failed:
            raise RuntimeError(f"hf_paged generate: row {failed[0].index} failed: {failed[0].error}")
        if self.streamer is not None:
            self.streamer.end()

    def result(self):
        steps = max(r.num_output_tokens for r in self.requests)
        steps = min(steps, self.length or steps)
        new = torch.tensor([r.output_token_ids[:steps] + [self.pad] * (steps - r.num_output_tokens)
                            for r in self.requests], dtype=torch.long)
        sequences = torch.cat([self.input_ids, new.to(self.input_ids.device)], dim=1)
        if not self.config.return_dict_in_generate:
            return sequences
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        cache = None
        if self.snapshots is not None:
            cache = self.snapshots.build(self.model, self.mask, self.input_ids.shape[1],
                                         [min(r.num_output_tokens, steps) for r in self.requests],
                                         sequences.shape[1] - 1, next(self.model.parameters()).dtype, self.block_size)
        return GenerateDecoderOnlyOutput(sequences=sequences, scores=self._stack(self.scores, steps),
                                         logits=self._stack(self.raw_logits, steps), cache=cache)

    def _stack(self, per_row: list[list[torch.Tensor]], steps: int):
        """Per-step [B, V] tensors as HF returns them; steps after a row finished hold zeros."""
        if not any(per_row):
            return None
        vocab = next(t for row in per_row for t in row).shape[-1]
        device = next(t for row in per_row for t in row).device
        out = []
        for step in range(steps):
            column = [row[step] if step < len(row) else torch.zeros(vocab, device=device) for row in per_row]
            out.append(torch.stack(column))
        return tuple(out)
