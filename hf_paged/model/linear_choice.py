"""Which product a few-row linear runs: measured on this machine, for the model's own weights, on first use.

`small_linear` has up to three ways to compute y = x W^T (+ b) for a handful of rows x: the native kernel, W @ x^T,
and F.linear. Which is fastest depends on the CPU (an AMX Xeon's MKL beat the kernel 1.7x; on an EPYC the kernel wins
2x on the LM head), on the weight's shape and on the row count. So nothing is assumed: the first call of each
`Key` (weight shape, dtype, row bucket, torch threads, whether the kernel loaded) times every candidate on that call's
own weight (`time_paths`), and the fastest is kept in a process-wide table (`TABLE`) that later calls read with one
dict lookup.

Invariants:
- A key is probed at most once per process (under `TABLE.lock`; a second thread waits for the first's result), unless
  `TABLE.clear()` is called. Probing never changes results beyond rounding: every candidate computes the same sums in
  another order, and the call that triggered the probe returns its own product afterwards.
- Row buckets are powers of two (`BUCKETS`): a call with m rows uses the smallest bucket >= m and its probe runs
  exactly that many rows (the bucket's top: the kernel pads to 16-row tiles, so 5..8 and 9..16 differ for F.linear
  but not for the kernel). Only buckets that calls actually reach are probed.
- The probe's cost is bounded per key: one warm-up call per candidate, then `MIN_ROUNDS`..`MAX_ROUNDS` rounds (as
  many as fit in `BUDGET_S`), each running every remaining candidate once in a rotating order; a candidate's time is
  its fastest round (noise only ever adds time). After the first round a candidate more than `DROP` (2; `LONG_DROP`,
  1.2, where the leader's call takes `LONG_S` or more) times slower
  than the leader in both its warm-up and that round is out (the LM head's losers: its probe then costs two calls of
  each). So a key costs at most about max(BUDGET_S, 3 calls of each candidate): a few ms for most weights. Weights
  that stay in the cache while probed (small ones) measured like cold ones to within a few percent on the EPYC, so the
  probe does not flush caches.
- Every fast path earns its place: F.linear (`BASELINE`) is kept unless another candidate measured more than `MARGIN`
  (5 %) faster, so near-ties (where noise would pick either, run to run) stay on the reference product; among the fast
  paths the least time wins, ties to the earlier one given (the kernel, then W @ x^T).
- With `HF_PAGED_SMALL_LINEAR_CACHE=1` choices are also kept on disk (`DiskChoices`), in the native-code cache
  folder (`native.cache_dir()`, checked like it: `native.private_folder`, only `native.trusted_file`s are read), one
  JSON file per machine: CPU model and flags, torch version and the kernel's source. Off by default: a choice
  measured while the machine was busy would otherwise outlive that moment.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from .. import native

logger = logging.getLogger("hf_paged")

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
BUCKET_OF = (0,) + tuple(next(b for b in BUCKETS if b >= m) for m in range(1, BUCKETS[-1] + 1))  # rows -> bucket
MIN_ROUNDS, MAX_ROUNDS = 2, 10
BUDGET_S = 0.005  # per key: rounds until their total would pass this (2..10: small weights 10, an LM head 2)
DROP = 2.0  # a candidate this many times slower than the leader in its warm-up and first round is not timed further
# ... or this many times, where the leader's call takes LONG_S or more (an LM head: timer and scheduling noise are a
# small part of such a call, and each further round costs tens of ms)
LONG_DROP, LONG_S = 1.2, 0.005
BASELINE, MARGIN = "f_linear", 0.05  # a fast path must beat F.linear by more than 5 % to be chosen
CACHE_SWITCH = "HF_PAGED_SMALL_LINEAR_CACHE"
clock = time.perf_counter  # module attribute: tests put a fake clock here


class Key(NamedTuple):
    """Equal to, and hashed like, the plain tuple (weight.shape, dtype, rows, threads, kernel) that calls look up."""
    shape: tuple  # (out_features, in_features): the weight's torch.Size
    dtype: Any  # torch.dtype
    rows: int  # the bucket: calls with rows up to this many (and more than the previous bucket)
    threads: int  # torch.get_num_threads() of the calling thread
    kernel: bool  # whether the native kernel was a candidate

    def text(self) -> str:
        return (f"{self.shape[0]}x{self.shape[1]} {str(self.dtype).replace('torch.', '')} rows<={self.rows} "
                f"threads={self.threads} kernel={int(self.kernel)}")


@dataclass
class Choice:
    """What one key runs: `path`'s name, every candidate's best seconds, and "probed" or "disk" (where it came from)."""
    path: str
    seconds: dict[str, float]
    source: str = "probed"
    probe_seconds: float = 0.0  # wall time the probe took (warm-up included)


def time_paths(runs: dict[str, Callable[[], object]], budget: float = BUDGET_S) -> tuple[dict[str, float], float]:
    """Each candidate's fastest time (s) over the rounds, and the probe's total wall time. See the module's invariants:
    one warm-up call each, then between MIN_ROUNDS and MAX_ROUNDS rotating rounds as `budget` allows; after the first
    round a candidate whose warm-up and first round both took over DROP times the leader's best is out (its time is
    the better of those two), and the rounds stop when one candidate is left."""
    started = clock()
    warm = {}
    for name in runs:
        t = clock()
        runs[name]()
        warm[name] = clock() - t
    rounds = max(MIN_ROUNDS, min(MAX_ROUNDS, int(budget / max(sum(warm.values()), 1e-9))))
    names, best = list(runs), dict.fromkeys(runs, math.inf)
    for r in range(rounds):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            t = clock()
            runs[name]()
            best[name] = min(best[name], clock() - t)
        if r == 0:  # two samples each: one slow call by chance (a busy machine) does not drop a candidate
            lead = min(min(warm[name], best[name]) for name in names)
            drop = LONG_DROP if lead >= LONG_S else DROP
            for name in [name for name in names if min(warm[name], best[name]) > drop * lead]:
                names.remove(name)
                best[name] = min(warm[name], best[name])
            if len(names) == 1:
                break
    return best, clock() - started


def fastest(seconds: dict[str, float], baseline: str = BASELINE) -> str:
    """`baseline` (F.linear) unless another candidate took less than (1 - MARGIN) of its time; then the one with the
    least time, the first one given among equals. Without the baseline among them: the least time."""
    best = min(seconds, key=lambda name: (seconds[name], list(seconds).index(name)))
    if baseline in seconds and seconds[best] >= (1 - MARGIN) * seconds[baseline]:
        return baseline
    return best


class DiskChoices:
    """Choices on disk for this machine (module docstring). Reading or writing failures only cost a re-probe."""

    def __init__(self, identity: str):
        digest = hashlib.sha256(f"{native.cpu_identity()} {identity}".encode()).hexdigest()[:16]
        self.path = native.cache_dir() / f"small_linear_choices_{digest}.json"

    def load(self) -> dict[str, dict]:
        try:
            native.check_folder(self.path.parent)
            if not native.trusted_file(self.path):
                return {}
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError, native.UnsafeCacheError):
            return {}

    def choice(self, key: Key, products: dict) -> Choice | None:
        """The saved choice for `key`, or None: none saved, or not one of `products` with a time for each of them
        (saved when other candidates were in play, or a damaged entry)."""
        saved = self.load().get(key.text())
        try:
            seconds = {name: float(value) for name, value in saved["seconds"].items()}
            if saved["path"] in products and set(seconds) == set(products):
                return Choice(saved["path"], seconds, source="disk")
        except (KeyError, TypeError, ValueError, AttributeError):
            pass
        return None

    def save(self, key: Key, choice: Choice) -> None:
        tmp = None
        try:
            folder = native.private_folder(self.path.parent)
            data = self.load()
            data[key.text()] = {"path": choice.path, "seconds": choice.seconds}
            fd, tmp = tempfile.mkstemp(dir=folder, suffix=".json")  # mode 0600
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=0, sort_keys=True)
            os.replace(tmp, self.path)  # atomic: a concurrent reader sees the old file or the new one
        except (OSError, native.UnsafeCacheError) as error:
            logger.debug("hf_paged: small-linear choices not saved to %s: %s", self.path, error)
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)


@dataclass
class ChoiceTable:
    """The process-wide table: `fast` maps a Key to the chosen product (read on every call, no lock), `choices` to its
    `Choice` (for reports). Both are only ever filled under `lock`."""
    fast: dict = field(default_factory=dict)
    choices: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    disk: dict = field(default_factory=dict)  # identity -> DiskChoices (only with HF_PAGED_SMALL_LINEAR_CACHE=1)

    def choose(self, key: Key, products: dict[str, Callable], runs: dict[str, Callable[[], object]],
               identity: str = "", baseline: str = BASELINE) -> Callable:
        """The product for `key`: the one chosen before, else one from disk (when enabled), else the fastest of
        `runs` (same names as `products`, each a closure running its product once on the caller's weight), `baseline`
        kept unless another is more than MARGIN faster. No run may call `choose` itself (the lock is not
        re-entrant): make any choice a run depends on first."""
        with self.lock:
            if key in self.fast:
                return self.fast[key]
            disk = self._disk(identity)
            choice = disk.choice(key, products) if disk else None
            if choice is None:
                seconds, spent = time_paths(runs)
                choice = Choice(fastest(seconds, baseline), seconds, probe_seconds=spent)
                if disk:
                    disk.save(key, choice)
            self.choices[key] = choice
            self.fast[key] = products[choice.path]
            return self.fast[key]

    def _disk(self, identity: str) -> DiskChoices | None:
        if os.environ.get(CACHE_SWITCH, "0") != "1":
            return None
        if identity not in self.disk:
            self.disk[identity] = DiskChoices(identity)
        return self.disk[identity]

    def clear(self) -> None:
        """Forget every choice (the next call of each key probes again)."""
        with self.lock:
            self.fast.clear()
            self.choices.clear()

    def report(self) -> list[dict]:
        """One dict per key chosen so far, sorted by shape, threads and rows: for `small_linear_status` and benches."""
        with self.lock:
            items = sorted(self.choices.items(), key=lambda kv: (tuple(kv[0].shape), str(kv[0].dtype), kv[0].threads,
                                                                 kv[0].rows))
        return [{"shape": list(k.shape), "dtype": str(k.dtype).replace("torch.", ""),
                 "rows": k.rows, "threads": k.threads, "kernel_available": k.kernel, "path": c.path,
                 "us": {name: round(s * 1e6, 1) for name, s in c.seconds.items()}, "source": c.source,
                 "probe_ms": round(c.probe_seconds * 1e3, 2)} for k, c in items]


TABLE = ChoiceTable()


def summary(report: list[dict]) -> str:
    """`report` in one line per (shape, dtype, threads): "512x512 float32 threads=1: 1 kernel, 4 kernel, 16 f_linear"
    (rows bucket then path), and the probes' total time."""
    lines: dict[tuple, list[str]] = {}
    for entry in report:
        head = (f"{entry['shape'][0]}x{entry['shape'][1]} {entry['dtype']} threads={entry['threads']}"
                + ("" if entry["kernel_available"] or entry["dtype"] != "float32" else " (no kernel)"))
        lines.setdefault(head, []).append(f"{entry['rows']} {entry['path']}")
    spent = sum(entry["probe_ms"] for entry in report)
    return "; ".join(f"{head}: {', '.join(parts)}" for head, parts in lines.items()) + \
        (f" (probes {spent:.0f} ms in all)" if report else "")

