"""kv/hashing.py: a block's key is a chain over every token before it and the request's cache salt."""
from hf_paged.kv.hashing import hash_block


def test_key_is_deterministic_and_covers_the_tokens():
    first = hash_block(None, [1, 2, 3, 4], None)
    assert first == hash_block(None, [1, 2, 3, 4], None) and len(first) == 16
    assert first != hash_block(None, [1, 2, 3, 5], None)
    assert first != hash_block(None, [1, 2, 3], None)


def test_key_covers_the_parent_chain():
    a, b = hash_block(None, [1, 2], None), hash_block(None, [9, 9], None)
    assert hash_block(a, [5, 6], None) != hash_block(b, [5, 6], None)  # same tokens after different prefixes
    assert hash_block(a, [5, 6], None) != hash_block(None, [5, 6], None)  # a first block is not a later one


def test_no_salt_the_empty_salt_and_other_salts_all_differ():
    keys = {hash_block(None, [1, 2], salt) for salt in (None, "", "a", "b")}
    assert len(keys) == 4
    assert hash_block(None, [1, 2], "a") == hash_block(None, [1, 2], "a")
