"""attention/backends/base.py: what every backend object is: the flag rules of `unsupported_reason` (checked before
its own layout rules), refused extras, the kind of call the chooser memoizes on (presence, never values) and the
per-step cache its layers share."""
import pytest
import torch

from hf_paged.attention import AttentionMetadata, LayerExtras
from hf_paged.attention.backends.base import AttentionBackend, CallKind, StepCache

CPU = torch.device("cpu")


def step(query_lens, context_lens):
    tables = [[1, 2, 3]] * len(query_lens)
    return AttentionMetadata.build(query_lens, context_lens, tables, list(range(sum(query_lens))), 4, CPU)


class DecodeOnly(AttentionBackend):
    name = "decode_only"
    prefill = False
    extras = frozenset({"sinks"})

    def layout_reason(self, query, key_cache, metadata, sliding_window, softcap):
        return "no soft-capping" if softcap else None


class PrefillOnly(AttentionBackend):
    name = "prefill_only"
    decode = False


def test_the_flags_are_checked_before_the_backends_own_rules():
    query, cache = torch.zeros(2, 4, 8), torch.zeros(5, 4, 2, 8)
    mixed, decodes = step([1, 1], [3, 5]), step([1], [3])
    assert "serves decode-only steps" in DecodeOnly().unsupported_reason(query, cache, step([2], [2]), None, None)
    assert "serves no decode rows" in PrefillOnly().unsupported_reason(query, cache, mixed, None, None)
    assert "does not read scaled fp8" in DecodeOnly().unsupported_reason(query, cache.to(torch.float8_e4m3fn),
                                                                         decodes, None, None)
    assert DecodeOnly().unsupported_reason(query, cache, decodes, None, 5.0) == "no soft-capping"
    strided = torch.zeros(5, 4, 4, 8)[:, :, :2]
    assert "contiguous pages only" in DecodeOnly().unsupported_reason(query, strided, decodes, None, None)
    assert DecodeOnly().unsupported_reason(query, cache, decodes, 7, None) is None


def test_extras_a_backend_does_not_implement_are_refused():
    backend = DecodeOnly()
    backend.check_extras(None)
    backend.check_extras(LayerExtras(sinks=torch.zeros(4)))
    with pytest.raises(ValueError, match=r"does not implement \['alibi'\]"):
        backend.check_extras(LayerExtras(sinks=torch.zeros(4), alibi_slopes=torch.ones(4)))


def test_a_call_kind_records_presence_never_values():
    query, cache = torch.zeros(3, 4, 8), torch.zeros(5, 4, 2, 8)
    one = CallKind.of(query, cache, step([2, 1], [2, 9]), 7, None)
    assert one == CallKind.of(query + 1, cache, step([3, 1], [3, 4]), 100, None)
    assert one != CallKind.of(query, cache, step([2, 1], [2, 9]), None, None)  # no window now
    assert one != CallKind.of(query, cache, step([1, 1], [2, 9]), 7, None)  # decodes only
    assert (one.heads, one.kv_heads, one.head_dim, one.block_size) == (4, 2, 8, 4)


def test_the_step_cache_is_rebuilt_for_each_new_step():
    cache, built = StepCache(), []
    first, second = step([1], [3]), step([1], [3])
    for metadata in (first, first, second):
        cache.get(metadata, "tables", lambda: built.append(metadata) or len(built))
    assert built == [first, second] and cache.get(second, "tables", lambda: None) == 2
