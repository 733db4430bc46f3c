"""Linear layers for few rows on CPU: y = (W x^T)^T instead of x W^T.

A decode step multiplies a handful of rows by every weight matrix of the model, so its time is the time to stream
the weights from memory. On CPU, MKL's sgemm streams a [out, in] weight about 1.3-1.6x faster when the weight is the
left operand (W @ x^T: many output rows, few columns) than in `F.linear`'s x @ W^T layout for M <= 32 rows (measured
in benchmarks/throughput.py's 16-request decode steps on a 2-vCPU Xeon: 36-44 ms -> 28-33 ms per step). On a 2-vCPU
EPYC it still wins at 64 rows (LM head [32000, 512]: 21 vs 28 ms; [1376, 512]: 0.76 vs 0.92 ms; 64-request decode
steps 97-109 -> 73-78 ms) and loses from about 96 rows on, hence MAX_ROWS = 64. The product is the same
mathematically; only the order of the floating-point sums differs (like any other kernel choice).

`SmallBatchLinears.active(num_rows)` swaps the `forward` of each plain `torch.nn.Linear` of the model (exact type:
subclasses such as quantized layers keep theirs) for the duration of one forward pass, and restores them after, even
on error. Only fp32 CPU weights take it; elsewhere it does nothing. `HF_PAGED_SMALL_LINEARS=0` turns it off.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

import torch

MAX_ROWS = 64  # above this the usual layout is as fast or faster
CHUNK = 4096  # output rows per product: keeps each piece of a large (LM head) weight streaming through the cache


def _small_batch_forward(module: torch.nn.Linear):
    weight, bias = module.weight, module.bias

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] > MAX_ROWS:
            return torch.nn.functional.linear(x, weight, bias)
        columns = rows.t()
        if weight.shape[0] > CHUNK:  # each piece lands transposed in place: one pass over the output
            out = rows.new_empty(rows.shape[0], weight.shape[0])
            for i in range(0, weight.shape[0], CHUNK):
                out[:, i:i + CHUNK] = torch.mm(weight[i:i + CHUNK], columns).t()
        else:
            out = torch.mm(weight, columns).t().contiguous()
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], weight.shape[0])

    return forward


class SmallBatchLinears:
    """The model's plain fp32 CPU linear layers, found once; `active(num_rows)` is a context for one forward."""

    def __init__(self, model: torch.nn.Module):
        enabled = os.environ.get("HF_PAGED_SMALL_LINEARS", "1") != "0"
        self.modules = [m for m in model.modules() if enabled and type(m) is torch.nn.Linear
                        and type(m.weight.data) is torch.Tensor  # not a tp_plan DTensor shard
                        and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]
        self.forwards = [_small_batch_forward(m) for m in self.modules]

    @contextmanager
    def active(self, num_rows: int):
        if num_rows > MAX_ROWS or not self.modules:
            yield
            return
        for module, forward in zip(self.modules, self.forwards):
            module.forward = forward
        try:
            yield
        finally:
            for module in self.modules:
                del module.forward  # the class's forward again
