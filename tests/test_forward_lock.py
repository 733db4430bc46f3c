"""model/forward_lock.py: one re-entrant lock per model, the same object for every caller and thread; copies and
pickles of the model get none (a placeholder that loads without hf_paged) and take their own on first use."""
import copy
import pickle
import threading

import torch

from hf_paged.model.forward_lock import KEY, ForwardLock, forward_lock


def test_one_reentrant_lock_per_model_whoever_asks():
    model, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(forward_lock(model))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(lock) for lock in seen}) == 1 and seen[0] is forward_lock(model)
    assert forward_lock(other) is not forward_lock(model)
    with forward_lock(model):
        with forward_lock(model):  # re-entrant in the holding thread
            pass
        got = []
        blocked = threading.Thread(target=lambda: got.append(forward_lock(model).acquire(timeout=0.05)))
        blocked.start()
        blocked.join()
        assert got == [False]  # another thread waits


def test_copies_and_pickles_get_a_lock_of_their_own():
    model = torch.nn.Linear(2, 2)
    lock = forward_lock(model)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert twin.__dict__[KEY] is False  # a placeholder, not the original's lock
        mine = forward_lock(twin)
        assert isinstance(mine, ForwardLock) and mine is not lock and forward_lock(twin) is mine
