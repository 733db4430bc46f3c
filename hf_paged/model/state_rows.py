"""A state run's rows of a packed step (every sequence's rows side by side in one row of the batch): cut out as the
batch the state module takes (`rows_of`, with `left_padding_mask`), and the modules' outputs put back in packed
order (`join`). A run's rows are a slice (one sequence, [1, L]), a tensor of row indices (single-token sequences,
[B, 1]) or a list of slices (sequences starting together, left-padded to the longest, [B, L])."""
from __future__ import annotations

import torch


def by_row(value, num_rows: int) -> bool:
    """Whether `value` holds one entry per packed row ([1, T, ...] tensors, or a tuple of them: rotary cos / sin)."""
    if isinstance(value, tuple):
        return bool(value) and all(by_row(v, num_rows) for v in value)
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == 1 and value.shape[1] == num_rows


def rows_of(value, rows):
    """The run's rows of a packed [1, T, ...] value: [1, L, ...] for one sequence, [B, 1, ...] for single tokens,
    [B, L, ...] left-padded with zeros for sequences that start here."""
    if isinstance(value, tuple):
        return tuple(rows_of(v, rows) for v in value)
    if isinstance(rows, list):
        width = max(r.stop - r.start for r in rows)
        padded = value.new_zeros((len(rows), width, *value.shape[2:]))
        for i, r in enumerate(rows):
            padded[i, width - (r.stop - r.start):] = value[0, r]
        return padded
    taken = value[0, rows]
    return taken[None] if isinstance(rows, slice) else taken[:, None]


def left_padding_mask(rows: list, device: torch.device) -> torch.Tensor | None:
    """HF's 2D mask of a left-padded batch (None when no row is padded, as HF passes it)."""
    lengths = [r.stop - r.start for r in rows]
    width = max(lengths)
    if min(lengths) == width:
        return None
    return (torch.arange(width, device=device)[None] >= torch.tensor([width - n for n in lengths],
                                                                      device=device)[:, None]).long()


def join(pieces: list, num_rows: int) -> torch.Tensor:
    """[(rows, output)] of the runs of a step, rows along dimension 1 of each output, as one packed [1, T, ...]."""
    parts = []
    for rows, out in pieces:
        if isinstance(rows, list):  # left-padded: each sequence's rows are the last ones of its line
            parts += [(r, out[i, out.shape[1] - (r.stop - r.start):]) for i, r in enumerate(rows)]
        else:
            parts.append((rows, out[0] if isinstance(rows, slice) else out[:, 0]))
    output = parts[0][1].new_empty((num_rows, *parts[0][1].shape[1:]))
    for rows, part in parts:
        output[rows] = part
    return output[None]
