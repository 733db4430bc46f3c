"""The kv state machine (tests/test_kv_state_machine.py) with block keys that collide: the pool's own checks (tokens,
parent block, parent incarnation) alone must keep every prefix hit right."""
from __future__ import annotations

from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

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
