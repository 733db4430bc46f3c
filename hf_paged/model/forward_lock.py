"""Each model's own forward lock: engines and HF-loop calls that switch a model's attention or linears hold it."""
from __future__ import annotations

import threading

KEY = "_hf_paged_forward_lock"  # where the lock lives in the model's __dict__
_PLACING = threading.Lock()  # serializes putting a first lock on a model (never held during a forward)


class ForwardLock:
    """A re-entrant lock that copies of the model do not share: `copy.deepcopy(model)` and pickling
    (`torch.save(model)`) leave `False` in its place (a checkpoint loads without hf_paged installed), and the copy
    gets a lock of its own on first use."""

    __slots__ = ("_lock",)

    def __init__(self):
        self._lock = threading.RLock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self):
        return self._lock.__enter__()

    def __exit__(self, *exc):
        return self._lock.__exit__(*exc)

    def __deepcopy__(self, memo):
        return False  # the copy gets a lock of its own on first use, after `drop_mid_forward_leftovers`

    def __reduce__(self):
        return bool, ()


def forward_lock(model) -> ForwardLock:
    """The model's own lock (made on first use, kept on the model object): engines hold it for a whole forward, in
    which they switch the model's attention implementation and linear layers, so two engines (or threads) on one
    model never interleave those switches and the model is always left as it was found. Every caller gets the same
    lock object for one model."""
    lock = model.__dict__.get(KEY)
    if isinstance(lock, ForwardLock):
        return lock
    with _PLACING:  # first use, or a loaded model carrying the placeholder: place exactly one lock
        lock = model.__dict__.get(KEY)
        if not isinstance(lock, ForwardLock):
            drop_mid_forward_leftovers(model)
            lock = model.__dict__[KEY] = ForwardLock()
        return lock


def drop_mid_forward_leftovers(model) -> None:
    """A model without a lock of its own is one nobody runs, so instance forwards of hf_paged's found on it are
    leftovers of a copy (`copy.deepcopy`, pickling) taken while another thread ran hf_paged on the original: they
    already run the copy's own forward (they switch only in the thread that installed them on the original), and
    are removed here so that the copy is exactly as the original was found. Configs are never switched by writing
    to them (`switches.switched_attention`), so a copy's config is the original's as the user left it."""
    from .small_linear import drop_leftover_forwards
    from .switches import drop_thread_forwards

    drop_leftover_forwards(model)
    drop_thread_forwards(model)
