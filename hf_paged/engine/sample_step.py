"""From a step's logits to one `Sampled` per request: the engine's own sampler, or a request's sampling hook."""
from __future__ import annotations

import torch

from ..config import logger
from ..request import Request
from ..sampling import Sampler
from .plan import Sampled


def sample_step(sampler: Sampler, requests: list[Request], logits: torch.Tensor) -> list[Sampled]:
    """`logits[j]` (float32; bf16 / fp16 where every request takes its first maximum) belongs to `requests[j]`. A
    row with NaN / inf ends its own request only; a hook (`request.controller`, e.g. HF's processors in the generate
    take-over) that raises ends only its requests.
    Changes no request: the scheduler applies the results."""
    results = [Sampled() for _ in requests]
    # NaN/inf anywhere poisons the sum, taken in float32 whatever the logits' dtype. For bf16, torch's own sum (it
    # accumulates in float32) first: asking for a float32 result casts all the logits (16 ms for 64 x 151,936); only
    # the rows it finds non-finite are summed again as float32 (a finite float32 sum may round to bf16's inf)
    finite: list[bool] = []
    if requests:
        if logits.dtype == torch.bfloat16:
            total = logits.sum(dim=-1)
            if not bool(torch.isfinite(total).all()):
                total = total.float()
                bad = (~torch.isfinite(total)).nonzero().flatten()
                total[bad] = logits[bad].sum(dim=-1, dtype=torch.float32)
        else:
            total = logits.sum(dim=-1, dtype=torch.float32)
        finite = torch.isfinite(total).tolist()
    native, hooked = [], {}
    for j, request in enumerate(requests):
        if not finite[j]:
            results[j] = Sampled(error="the model produced non-finite logits for this request", non_finite=True)
        elif request.controller is None:
            native.append(j)
        else:
            hooked.setdefault(id(request.controller), []).append(j)
    if native:
        _sample_natively(sampler, requests, logits, native, results)
    for members in hooked.values():
        _sample_with_hook(requests, logits, members, results)
    return results


def _sample_natively(sampler: Sampler, requests: list[Request], logits: torch.Tensor, members: list[int],
                     results: list[Sampled]) -> None:
    rows = logits if len(members) == len(requests) else logits[torch.tensor(members, device=logits.device)]
    group = [requests[j] for j in members]
    out = sampler(rows, [r.params for r in group], [r.all_token_ids for r in group],
                  [r.output_token_ids for r in group], [r.generator for r in group],
                  [r.banned_token_ids() for r in group])
    for k, j in enumerate(members):
        results[j] = Sampled(token=out.token_ids[k], logprobs=out.logprobs[k])


def _sample_with_hook(requests: list[Request], logits: torch.Tensor, members: list[int],
                      results: list[Sampled]) -> None:
    group = [requests[j] for j in members]
    try:
        picks = group[0].controller.process(group, logits[torch.tensor(members, device=logits.device)])
    except Exception as e:  # noqa: BLE001 - a user hook failing ends only its own requests
        logger.debug("hf_paged: sampling hook failed: %r", e)
        for j in members:
            results[j] = Sampled(error=f"{type(e).__name__}: {e}")
        return
    for j, (token, stop_now) in zip(members, picks):
        results[j] = Sampled(token=token, stop_now=stop_now)
