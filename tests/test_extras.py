"""attention/extras.py: what a layer adds to plain causal attention (names a backend must support; all-None is plain
attention) and the dense reference pieces: the mask, the ALiBi bias and the relative-position bias."""
import torch

from hf_paged.attention.extras import LayerExtras, alibi_bias, allowed, relative_bias


def test_names_say_what_a_backend_must_support():
    assert not LayerExtras().any() and LayerExtras(chunk_size=0).names() == frozenset()
    both = LayerExtras(sinks=torch.zeros(2), relative_logits=torch.zeros(1, 2, 3))
    assert both.names() == {"sinks", "relative"} and LayerExtras(alibi_slopes=torch.ones(2), chunk_size=4).names() == {
        "alibi", "chunked"}


def test_allowed_is_causal_within_window_and_chunk():
    q, k = torch.tensor([5]), torch.arange(8)
    assert allowed(q, k, None, None)[0].tolist() == [True] * 6 + [False] * 2
    assert allowed(q, k, 3, None)[0].tolist() == [False] * 3 + [True] * 3 + [False] * 2
    assert allowed(q, k, None, 4)[0].tolist() == [False] * 4 + [True] * 2 + [False] * 2


def test_alibi_adds_slope_times_backward_distance():
    bias = alibi_bias(torch.tensor([1.0, 0.5]), torch.tensor([2]), torch.arange(3))
    assert bias.shape == (2, 1, 3) and bias[:, 0].tolist() == [[-2.0, -1.0, 0.0], [-1.0, -0.5, 0.0]]


def test_relative_bias_takes_entry_q_minus_k_and_nothing_from_further_back():
    rows = torch.tensor([[[10.0, 20.0]]])  # one query, one head, extent 2: distance 0 -> 10, distance 1 -> 20
    bias = relative_bias(rows, torch.tensor([3]), torch.arange(5))
    assert bias[0, 0].tolist() == [0.0, 0.0, 20.0, 10.0, 0.0]  # keys 2 and 3; none 2+ back, none ahead
