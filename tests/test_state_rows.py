"""model/state_rows.py: a state run's rows cut out of a packed step (one sequence, single tokens, or sequences
left-padded to the longest) and the outputs joined back in packed order."""
import torch

from hf_paged.model.state_rows import by_row, join, left_padding_mask, rows_of

PACKED = torch.arange(1, 9, dtype=torch.float32).view(1, 8, 1)  # eight packed rows holding 1..8


def test_by_row_knows_per_row_values():
    assert by_row(PACKED, 8) and by_row((PACKED, PACKED), 8)
    assert not by_row(PACKED, 7) and not by_row((), 8) and not by_row(torch.ones(8), 8) and not by_row(3, 8)


def test_one_sequence_single_tokens_and_left_padded_sequences():
    assert rows_of(PACKED, slice(2, 5)).flatten().tolist() == [3, 4, 5]
    single = rows_of(PACKED, torch.tensor([0, 6]))
    assert single.shape == (2, 1, 1) and single.flatten().tolist() == [1, 7]
    padded = rows_of(PACKED, [slice(0, 2), slice(2, 6)])
    assert padded.squeeze(-1).tolist() == [[0, 0, 1, 2], [3, 4, 5, 6]]
    cos_sin = rows_of((PACKED, -PACKED), slice(0, 1))
    assert [t.item() for t in cos_sin] == [1, -1]


def test_left_padding_mask_as_hf_passes_it():
    assert left_padding_mask([slice(0, 3), slice(3, 6)], torch.device("cpu")) is None
    mask = left_padding_mask([slice(0, 1), slice(1, 4)], torch.device("cpu"))
    assert mask.tolist() == [[0, 0, 1], [1, 1, 1]]


def test_join_puts_every_run_back_in_packed_order():
    runs = [slice(5, 8), torch.tensor([0, 4]), [slice(1, 2), slice(2, 4)]]
    pieces = [(rows, rows_of(PACKED, rows) * 10) for rows in runs]
    assert torch.equal(join(pieces, 8), PACKED * 10)
