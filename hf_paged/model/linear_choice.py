"""Which product a few-row linear runs: measured on this machine, for the model's own weights, on first use.

`small_linear` has up to four ways to compute y = x W^T (+ b) for a handful of rows x: the native kernel, W @ x^T, x @
a transposed copy of W (`transposed_copy`) and F.linear. Which is fastest depends on the CPU (an AMX Xeon's MKL beat
the kernel 1.7x; on an EPYC the kernel wins 2x on the LM head), on the weight's shape, on the row count and on what
the cache holds when the call comes. So nothing is assumed: the first calls of each `Key` (weight shape, dtype, row
bucket, torch threads, whether the kernel loaded) run and time the candidates in turn on the model's own weights in
its own forwards (`Trial`), and the fastest is kept in a process-wide table (`TABLE`) that later calls read with one
dict lookup.

Invariants:
- A key is measured at most once per process (under `TABLE.lock`), unless `TABLE.clear()` is called. Measuring never
  changes results beyond rounding: every candidate computes the same sums in another order.
- Row buckets are powers of two (`BUCKETS`; beyond them `many_bucket`, up to MANY_MAX): a call with m rows uses the
  smallest bucket >= m. Only buckets that calls actually reach are measured.
- Measured where it runs (`Trial`): a key without a choice gives each call one of its candidates in turn (every block
  of as many calls as candidates runs each once, the order rotating so that layers of one shape called alternately
  all meet every candidate) and times that call itself, inside the real forward: with the caches as a real step leaves
  them. A weight read once per step (a decode step streams every layer's weights: more than the last-level cache on
  the 2-core Xeon VM of issue 27, where a 64-row product took twice as long in the step as in a loop over the same
  weight) is timed cold, one the cache keeps is timed warm, each as it will run. The first call of each candidate is
  a warm-up (not counted); after one counted call each, a candidate whose better call is more than `DROP` (2;
  `LONG_DROP`, 1.2, where the leader's call takes `LONG_S` or more) times the leader's is out; once every candidate
  left has `SAMPLES` counted calls, each one's time is the median of them and the choice is made. So a key costs
  (1 + SAMPLES) calls of each candidate, fewer of the clear losers: a few steps.
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
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from .. import native

logger = logging.getLogger("hf_paged")

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
BUCKET_OF = (0,) + tuple(next(b for b in BUCKETS if b >= m) for m in range(1, BUCKETS[-1] + 1))  # rows -> bucket
MANY_MAX = 16384  # the last bucket of many rows (a prefill step's): calls of this many rows or more


def many_bucket(rows: int) -> int:
    """The bucket of a call of more than BUCKETS[-1] rows: the next power of two, at most MANY_MAX."""
    return min(1 << (rows - 1).bit_length(), MANY_MAX)


SAMPLES = 5  # counted calls of each candidate before a choice (after one warm-up call each)
DROP = 2.0  # a candidate this many times slower than the leader in its warm-up and first counted call is out
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
    """What one key runs: `path`'s name, every candidate's measured seconds (the median of its counted calls; a
    candidate dropped early: its better call), where it came from ("measured", "disk", or "only candidate" where one
    was left to choose), and the time the measured calls took in all (warm-ups included)."""
    path: str
    seconds: dict[str, float]
    source: str = "measured"
    probe_seconds: float = 0.0


@dataclass
class Trial:
    """A key being measured on real calls (module invariants): `next()` names the candidate the next call runs,
    `add()` takes that call's time and says, once the trial is complete, each candidate's seconds."""
    products: dict[str, Callable]  # name -> product, in tie-break order
    names: list[str] = field(default_factory=list)  # candidates still in
    warm: dict[str, float] = field(default_factory=dict)  # each candidate's warm-up call
    times: dict[str, list[float]] = field(default_factory=dict)  # each candidate's counted calls
    calls: int = 0
    spent: float = 0.0
    pruned: bool = False

    def __post_init__(self):
        self.names = list(self.products)
        self.times = {name: [] for name in self.products}

    def next(self) -> str:
        n = len(self.names)  # calls c, c+1, ... c+n-1 of one block (same c // n) run every candidate once
        name = self.names[(self.calls + self.calls // n) % n]
        self.calls += 1
        return name

    def _best(self, name: str) -> float:
        return min([self.warm.get(name, math.inf)] + self.times[name])

    def add(self, name: str, seconds: float) -> dict[str, float] | None:
        """Record one call of `name`; each candidate's seconds once every candidate left has SAMPLES counted calls
        (medians; a dropped one: its better call), else None."""
        self.spent += seconds
        if name not in self.names:
            return None  # dropped meanwhile (another thread's call)
        if name not in self.warm:
            self.warm[name] = seconds
        else:
            self.times[name].append(seconds)
        if not self.pruned and all(self.times[n] for n in self.names):
            self.pruned = True  # two calls each: one slow call by chance (a busy machine) does not drop a candidate
            lead = min(self._best(n) for n in self.names)
            drop = LONG_DROP if lead >= LONG_S else DROP
            self.names = [n for n in self.names if self._best(n) <= drop * lead]
        if any(len(self.times[n]) < SAMPLES for n in self.names):
            return None
        return {name: (statistics.median(self.times[name]) if name in self.names else self._best(name))
                for name in self.products if name in self.warm}


def fastest(seconds: dict[str, float], baseline: str = BASELINE) -> str:
    """`baseline` (F.linear) unless another candidate took less than (1 - MARGIN) of its time; then the one with the
    least time, the first one given among equals. Without the baseline among them: the least time."""
    best = min(seconds, key=lambda name: (seconds[name], list(seconds).index(name)))
    if baseline in seconds and seconds[best] >= (1 - MARGIN) * seconds[baseline]:
        return baseline
    return best


class DiskChoices:
    """Choices on disk for this machine (module docstring). Reading or writing failures only cost a new trial."""

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
    trials: dict = field(default_factory=dict)  # Key -> Trial: keys being measured

    def pick(self, key: Key, products: dict[str, Callable], identity: str = "") -> tuple[str | None, Callable]:
        """For a call of `key`: (None, the product) where the choice is made (before, or now from disk, or
        `products` holds one candidate), else (name, product) of the candidate this call runs for the trial; the
        caller times that call and hands its time to `record`. `products`: name -> product in tie-break order,
        the same on every call of the key."""
        with self.lock:
            if key in self.fast:
                return None, self.fast[key]
            trial = self.trials.get(key)
            if trial is None:
                disk = self._disk(identity)
                choice = disk.choice(key, products) if disk else None
                if choice is None and len(products) == 1:
                    choice = Choice(next(iter(products)), {}, source="only candidate")
                if choice is not None:
                    return None, self._decide(key, choice, products)
                trial = self.trials[key] = Trial(dict(products))
            name = trial.next()
            return name, trial.products[name]

    def record(self, key: Key, name: str, seconds: float, identity: str = "", baseline: str = BASELINE) -> bool:
        """One trial call's time (`pick` gave `name`); True when it completed the trial and the choice is made.
        `baseline` is kept unless another candidate left in the trial measured more than MARGIN faster."""
        with self.lock:
            trial = self.trials.get(key)
            if trial is None or key in self.fast:
                return False
            seconds_each = trial.add(name, seconds)
            if seconds_each is None:
                return False
            left = {n: seconds_each[n] for n in trial.names}
            choice = Choice(fastest(left, baseline), seconds_each, probe_seconds=trial.spent)
            disk = self._disk(identity)
            if disk:
                disk.save(key, choice)
            self._decide(key, choice, trial.products)
            return True

    def timed(self, key: Key, name: str | None, run: Callable[[], Any], identity: str = "",
              baseline: str = BASELINE) -> tuple[Any, bool]:
        """`run()` for a call that `pick` named `name`: timed and recorded when it is a trial call (`name` not None).
        Returns its result and whether its time completed the trial (the choice is then in `fast`)."""
        if name is None:
            return run(), False
        started = clock()
        result = run()
        return result, self.record(key, name, clock() - started, identity, baseline)

    def _decide(self, key: Key, choice: Choice, products: dict[str, Callable]) -> Callable:
        self.trials.pop(key, None)
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
        """Forget every choice and trial (the next calls of each key measure again)."""
        with self.lock:
            self.fast.clear()
            self.choices.clear()
            self.trials.clear()

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
    (rows bucket then path), and the measured calls' total time."""
    lines: dict[tuple, list[str]] = {}
    for entry in report:
        head = (f"{entry['shape'][0]}x{entry['shape'][1]} {entry['dtype']} threads={entry['threads']}"
                + ("" if entry["kernel_available"] or entry["dtype"] != "float32" else " (no kernel)"))
        lines.setdefault(head, []).append(f"{entry['rows']} {entry['path']}")
    spent = sum(entry["probe_ms"] for entry in report)
    return "; ".join(f"{head}: {', '.join(parts)}" for head, parts in lines.items()) + \
        (f" (measured calls {spent:.0f} ms in all)" if report else "")

