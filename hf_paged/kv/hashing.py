"""Block keys for prefix reuse: a keyed hash chain over token ids.

Block i's key covers every token up to the end of block i (its parent's key is hashed in) plus the
request's cache salt. The hash is keyed with a per-process random secret, so keys cannot be predicted
or forged from outside; a hit is still confirmed by comparing the block's token ids.
"""
from __future__ import annotations

import hashlib
import os
from array import array
from typing import Sequence

_SECRET = os.urandom(32)  # fixed for the life of the process; never shared
_ROOT = b"\x00" * 16


def hash_block(parent: bytes | None, token_ids: Sequence[int], salt: str | None) -> bytes:
    digest = hashlib.blake2b(digest_size=16, key=_SECRET)
    digest.update(parent or _ROOT)
    # no salt and the empty salt differ: a request that names any salt shares blocks only with that very salt
    digest.update(b"\x00" if salt is None else b"\x01" + salt.encode() + b"\x00")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()
