"""The kv state machine (tests/test_kv_state_machine.py) with block keys that collide: the pool's own checks (tokens,
parent block, parent incarnation) alone must keep every prefix hit right."""
from __future__ import annotations

from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from hf_paged.kv import BlockPool
from hf_paged.kv import manager as kv_manager
from hf_paged.kv.hashing import hash_block
from test_kv_state_machine import SETTINGS, KVMachine


def colliding_hash(parent: bytes | None, token_ids, salt: str | None) -> bytes:
    """Block keys that forget the prefix: any two blocks with the same tokens and salt collide, whatever came
    before them. Only the pool's own checks (tokens, parent block, parent incarnation) keep hits right then."""
    return hash_block(None, token_ids, salt)


class CollidingKeysMachine(KVMachine):
    exact_hash = False


def test_colliding_keys_never_serve_wrong_kv(monkeypatch):
    monkeypatch.setattr(kv_manager, "hash_block", colliding_hash)
    run_state_machine_as_test(CollidingKeysMachine, settings=settings(SETTINGS, max_examples=100))


def test_lookup_never_follows_a_later_incarnation_of_the_parent():
    """The one pool check the machines rarely reach: a cached child whose parent block was uncached (discarded),
    handed out again and cached anew for the same tokens is no hit after the new parent, even under a colliding key."""
    pool = BlockPool(4)
    parent, child = pool.allocate(2)
    pool.cache(parent, b"p", [1, 2], None)
    pool.cache(child, b"c", [3, 4], pool.blocks[parent])
    assert pool.lookup(b"c", [3, 4], pool.blocks[parent]) is pool.blocks[child]
    pool.uncache(parent)  # discard_contents of a request that held the parent only
    pool.free([parent])
    assert pool.allocate(1) == [parent]  # unhashed: handed out first, new contents
    pool.cache(parent, b"p2", [1, 2], None)
    assert pool.lookup(b"c", [3, 4], pool.blocks[parent]) is None
    pool.free([parent, child])
    pool.check_all_free()
