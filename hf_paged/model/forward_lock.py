"""Each model's own forward lock: engines and HF-loop calls that switch a model's attention or linears hold it."""
from __future__ import annotations

import threading


class ForwardLock:
    """A re-entrant lock that a copy of the model gets afresh: `copy.deepcopy(model)` and pickling (`torch.save`)
    make a new model, which must not share (and cannot copy) the original's lock."""

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
        return ForwardLock()

    def __reduce__(self):
        return ForwardLock, ()


def forward_lock(model) -> ForwardLock:
    """The model's own lock (made on first use, kept on the model object): engines hold it for a whole forward, in
    which they switch the model's attention implementation and linear layers, so two engines (or threads) on one
    model never interleave those switches and the model is always left as it was found."""
    return model.__dict__.setdefault("_hf_paged_forward_lock", ForwardLock())  # dict.setdefault is atomic
