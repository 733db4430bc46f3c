"""One `generate(cache_implementation="paged")` call executed on the engine, with HF's exact semantics:
HF's own logits processors and stopping criteria, streamer columns, padding and the same return types."""
from __future__ import annotations

import torch

from ..config import EngineConfig
from ..engine import Engine
from ..kv import blocks_needed
from ..request import Request
from ..sampling import SamplingParams

_NATIVE_CRITERIA = ("MaxLengthCriteria", "EosTokenCriteria")


class GenerateRun:
    """Sampling controller for the rows of one generate call (the engine's `controller` protocol:
    `process(requests, logits) -> [(token, stop_now)]`).

    HF sees, per row, exactly the `input_ids` its own loop would hold: the row as passed in (padding
    kept) followed by the tokens generated so far. Rows sampled together in one step with equal lengths
    go through the processors and criteria as one batch, in their original order.
    """

    def __init__(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, generation_config,
                 logits_processor, stopping_criteria, streamer):
        self.model = model
        self.input_ids = input_ids
        self.rows = input_ids.tolist()
        mask = attention_mask.tolist() if attention_mask is not None else None
        # the real tokens of each row (left or right padding removed); positions restart at 0 like HF's
        self.prompts = [[t for t, m in zip(row, mask[b]) if m] if mask is not None else list(row)
                        for b, row in enumerate(self.rows)]
        self.config = generation_config
        self.logits_processor = logits_processor
        self.stopping_criteria = stopping_criteria
        self.streamer = streamer
        self.do_sample = bool(generation_config.do_sample)
        self.want_scores = bool(generation_config.return_dict_in_generate and generation_config.output_scores)
        self.want_logits = bool(generation_config.return_dict_in_generate and generation_config.output_logits)
        pad = generation_config._pad_token_tensor
        eos = generation_config._eos_token_tensor
        self.eos = [] if eos is None else [int(t) for t in eos.reshape(-1).tolist()]
        self.pad = int(pad) if pad is not None else (self.eos[0] if self.eos else 0)
        self.max_new_tokens = max(1, generation_config.max_length - input_ids.shape[1])
        self.scores: list[list[torch.Tensor]] = [[] for _ in self.rows]
        self.raw_logits: list[list[torch.Tensor]] = [[] for _ in self.rows]
        self.requests: list[Request] = []
        self.streamed = 0

    @property
    def native(self) -> bool:
        """True when the engine's own greedy sampler gives HF's result (no processors, only length / EOS stops)."""
        return (not self.do_sample and len(self.logits_processor) == 0 and not self.want_scores
                and not self.want_logits
                and all(type(c).__name__ in _NATIVE_CRITERIA for c in self.stopping_criteria))

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_new_tokens, temperature=0.0, ignore_eos=True,
                              stop_token_ids=list(self.eos) if self.native else [])

    def engine_config(self, options: dict | None) -> EngineConfig:
        """The caller's cache_config; without a pool size, exactly what this batch needs (no preemption)."""
        options = dict(options or {})
        config = EngineConfig.from_dict(options)
        if config.num_blocks is None and config.kv_cache_memory is None:
            need = sum(blocks_needed(len(p) + self.max_new_tokens, config.block_size) for p in self.prompts)
            config = config.replace(num_blocks=need + 1)
        return config

    # ---- controller protocol ------------------------------------------------------------------------
    def _history(self, request: Request) -> list[int]:
        return self.rows[request.index] + request.output_token_ids

    def process(self, requests: list[Request], logits: torch.Tensor) -> list[tuple[int, bool]]:
        order = sorted(range(len(requests)), key=lambda i: requests[i].index)
        picks: list[tuple[int, bool] | None] = [None] * len(requests)
        by_length: dict[int, list[int]] = {}
        for i in order:
            by_length.setdefault(len(self._history(requests[i])), []).append(i)
        for members in by_length.values():
            ids = torch.tensor([self._history(requests[i]) for i in members], dtype=torch.long,
                               device=logits.device)
            raw = logits[torch.tensor(members, device=logits.device)]
            scores = self.logits_processor(ids, raw.clone())
            if self.do_sample:
                tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            else:
                tokens = scores.argmax(dim=-1)
            stop = self.stopping_criteria(torch.cat([ids, tokens[:, None]], dim=-1), scores)
            for j, i in enumerate(members):
                row = requests[i].index
                if self.want_scores:
                    self.scores[row].append(scores[j])
                if self.want_logits:
                    self.raw_logits[row].append(raw[j])
                picks[i] = (int(tokens[j]), bool(stop[j]))
        return picks

    # ---- streaming and results --------------------------------------------------------------------
    def _column(self, step: int) -> list[int]:
        return [r.output_token_ids[step] if step < r.num_output_tokens else self.pad for r in self.requests]

    def stream_ready(self) -> None:
        """Hand the streamer every step column that all rows have produced (finished rows give pad)."""
        if self.streamer is None:
            return
        while True:
            step = self.streamed
            if not all(r.num_output_tokens > step or r.is_finished for r in self.requests):
                return
            if all(r.num_output_tokens <= step for r in self.requests):
                return
            self.streamer.put(torch.tensor(self._column(step), dtype=torch.long))
            self.streamed += 1

    def run(self, engine: Engine) -> None:
        params = self.sampling_params()
        controller = None if self.native else self
        for b, prompt in enumerate(self.prompts):
            self.requests += engine.add_request(prompt, params, index=b, controller=controller)
        while engine.has_unfinished:
            engine.step()
            self.stream_ready()
        failed = [r for r in self.requests if r.finish_reason == "error"]
        if failed:
            raise RuntimeError(f"hf_paged generate: row {failed[0].index} failed: {failed[0].error}")
        if self.streamer is not None:
            self.streamer.end()

    def result(self):
        steps = max(r.num_output_tokens for r in self.requests)
        new = torch.tensor([r.output_token_ids + [self.pad] * (steps - r.num_output_tokens) for r in self.requests],
                           dtype=torch.long)
        sequences = torch.cat([self.input_ids, new.to(self.input_ids.device)], dim=1)
        if not self.config.return_dict_in_generate:
            return sequences
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=sequences, scores=self._stack(self.scores, steps),
                                         logits=self._stack(self.raw_logits, steps))

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
