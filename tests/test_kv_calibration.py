"""model/kv_calibration.py: fp8 KV scales from given values or from one fixed calibration forward: fixed sequences,
power-of-two scales with the documented headroom, and a clear refusal of malformed `kv_scales`."""
import math
from types import SimpleNamespace

import pytest

from hf_paged.attention.torch_backend import FP8_MAX
from hf_paged.model import describe_model
from hf_paged.model.kv_calibration import (CALIBRATION_LENGTH, CALIBRATION_SEQUENCES, HEADROOM, calibration_sequences,
                                           fixed_scales, measure_kv_maxima, scales_from_maxima)

from conftest import cached_model


def test_calibration_sequences_are_fixed_start_with_bos_and_fit_the_length():
    spec = SimpleNamespace(vocab_size=50)
    first = calibration_sequences(spec, 1, 4096)
    assert first == calibration_sequences(spec, 1, 4096) and len(first) == CALIBRATION_SEQUENCES
    assert all(len(s) == CALIBRATION_LENGTH and s[0] == 1 and max(s) < 50 for s in first)
    assert [len(s) for s in calibration_sequences(spec, None, 10)] == [10] * CALIBRATION_SEQUENCES
    assert calibration_sequences(spec, 99, 10) == calibration_sequences(spec, None, 10)  # a BOS outside the vocab


def test_scales_are_the_smallest_powers_of_two_with_the_headroom():
    maxima = [(1.0, 0.003), (250.0, 1e-9)]
    for scale, top in zip((s for pair in scales_from_maxima(maxima) for s in pair), (t for p in maxima for t in p)):
        assert math.log2(scale).is_integer() and top * HEADROOM <= scale * FP8_MAX < 2 * top * HEADROOM
    assert scales_from_maxima([(0.0, math.nan), (math.inf, 1.0)])[:1] == [(1.0, 1.0)]


def test_given_scales_as_a_number_or_pairs_and_malformed_ones_refused():
    assert fixed_scales(0.5, 2) == [(0.5, 0.5), (0.5, 0.5)]
    assert fixed_scales([(1, 2), (3, 4)], 2) == [(1.0, 2.0), (3.0, 4.0)]
    for bad in (True, "big", [(1.0, 1.0)] * 3, [(1.0,), (1.0,)], [(1.0, 0.0), (1.0, 1.0)], [(1.0, math.nan)] * 2):
        with pytest.raises(ValueError, match="kv_scales"):
            fixed_scales(bad, 2)


def test_every_layer_is_measured_the_same_each_time():
    model = cached_model("llama")
    spec = describe_model(model)
    sequences = [[1, 5, 9, 30, 7], [1, 3]]
    maxima = measure_kv_maxima(model, spec, sequences)
    assert len(maxima) == spec.kv.num_layers and all(math.isfinite(t) and t > 0 for pair in maxima for t in pair)
    assert measure_kv_maxima(model, spec, sequences) == maxima
