"""kv/manager.py: the engine's KV manager grows and frees block tables, clears blocks before use, keeps and drops
prefix-map entries."""
from hf_paged.kv import KVCacheManager
from hf_paged.request import Request, ParentRequest
from hf_paged.sampling import SamplingParams


def make_request(tokens, **params):
    group = ParentRequest("r", 0, None, list(tokens))
    return Request(group, list(tokens), SamplingParams(**params))


def test_manager_grows_tables():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    req = make_request(range(6))
    assert kv.allocate_slots(req, 6) and len(req.block_table) == 2
    req.num_computed_tokens = 6
    assert kv.allocate_slots(req, 2) and len(req.block_table) == 2  # still fits block 2
    assert not kv.allocate_slots(req, 20)  # refuses, changes nothing
    assert len(req.block_table) == 2
    kv.free(req)
    assert req.block_table == [] and kv.num_free_blocks == 4


def test_blocks_are_cleared_once_and_again_after_their_contents_were_discarded():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    req = make_request(range(8))
    assert kv.allocate_slots(req, 8)
    first = list(req.block_table)
    assert sorted(kv.take_blocks_to_clear()) == sorted(first)  # never used: clear before the first forward
    kv.free(req)
    assert kv.allocate_slots(req, 8) and kv.take_blocks_to_clear() == []  # clean since: nothing to clear
    kv.discard_contents(req)  # e.g. its K/V went NaN
    kv.free(req)
    assert kv.allocate_slots(req, 8) and sorted(kv.take_blocks_to_clear()) == sorted(req.block_table)


def test_discarded_blocks_leave_the_prefix_map():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = make_request(range(9))
    assert kv.allocate_slots(req, 9)
    req.num_computed_tokens = 9
    kv.cache_full_blocks(req)
    again = make_request(range(9))
    assert len(kv.computed_blocks(again)) == 2
    kv.discard_contents(req)
    assert kv.computed_blocks(make_request(range(9))) == []


def test_prefix_hits_never_cover_the_last_prompt_token():
    """A prompt of whole blocks that is all cached still computes its last token (its logits are sampled), even
    after its hash chain was extended further (as happens while it waits for a prefix being computed)."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    long = make_request(range(12))
    assert kv.allocate_slots(long, 12)
    long.num_computed_tokens = 12
    kv.cache_full_blocks(long)
    short = make_request(range(8))
    assert kv.common_prefix_blocks(short, long) == 2  # computes both of its block hashes
    assert len(kv.computed_blocks(short)) == 1
