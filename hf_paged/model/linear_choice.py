"""Which product a few-row linear runs: measured on this machine, for the model's own weights, on first use.

`small_linear` has up to four ways to compute y = x W^T (+ b) for a handful of rows x: the native kernel, W @ x^T, x @
a transposed copy of W (`transposed_copy`) and F.linear. Which is fastest depends on the CPU (an AMX Xeon's MKL beat
the kernel 1.7x; on an EPYC the kernel wins 2x on the LM head), on the weight's shape, on the row count and on what
the cache holds when the call comes. So nothing is assumed: the first calls of each `Key` (weight shape, dtype, row
bucket, torch threads, whether the kernel loaded) run and time the candidates in turn on the model's own weights in
its own forwards (`trials.Trial`), and the fastest is kept in a process-wide table (`TABLE`) that later calls read
with one dict lookup.

Invariants:
- A key is measured at most once per process (under `TABLE.lock`), unless `TABLE.clear()` is called. Measuring never
  changes results beyond rounding: every candidate computes the same sums in another order.
- Row buckets are powers of two (`BUCKETS`; beyond them `many_bucket`, up to MANY_MAX): a call with m rows uses the
  smallest bucket >= m. Only buckets that calls actually reach are measured.
- Measured where it runs (`hf_paged.trials`: the trial's rotation, warm-up, early drop and medians): a key without
  a choice gives each call one of its candidates in turn and times that call itself, inside the real forward: with
  the caches as a real step leaves them. A weight read once per step (a decode step streams every layer's weights:
  more than the last-level cache on the 2-core Xeon VM of issue 27, where a 64-row product took twice as long in the
  step as in a loop over the same weight) is timed cold, one the cache keeps is timed warm, each as it will run.
- Every fast path earns its place: F.linear (`BASELINE`) is kept unless another candidate measured more than
  `trials.MARGIN` (5 %) faster; among the fast paths the least time wins, ties to the earlier one given (the kernel,
  then W @ x^T).
- With `HF_PAGED_SMALL_LINEAR_CACHE=1` choices are also kept on disk (`DiskChoices`), in the native-code cache
  folder (`native.cache_dir()`, checked like it: `native.private_folder`, only `native.trusted_file`s are read), one
  JSON file per machine: CPU model and flags, torch version and the kernel's source. Off by default: a choice
  measured while the machine was busy would otherwise outlive that moment.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from typing import Any, Callable, NamedTuple

from .. import native, trials
from ..trials import Choice

logger = logging.getLogger("hf_paged")

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
BUCKET_OF = (0,) + tuple(next(b for b in BUCKETS if b >= m) for m in range(1, BUCKETS[-1] + 1))  # rows -> bucket
MANY_MAX = 16384  # the last bucket of many rows (a prefill step's): calls of this many rows or more


def many_bucket(rows: int) -> int:
    """The bucket of a call of more than BUCKETS[-1] rows: the next power of two, at most MANY_MAX."""
    return min(1 << (rows - 1).bit_length(), MANY_MAX)


BASELINE = "f_linear"  # the reference product every fast path must beat (trials.fastest)
CACHE_SWITCH = "HF_PAGED_SMALL_LINEAR_CACHE"


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


class ChoiceTable(trials.Table):
    """The process-wide table (`trials.Table`, baseline F.linear) and `fast`: a Key -> the chosen product (read on
    every call, no lock), filled under `lock` with its `Choice`; with HF_PAGED_SMALL_LINEAR_CACHE=1 also the choices
    on disk (`disk`: identity -> DiskChoices)."""

    def __init__(self):
        super().__init__(BASELINE)
        self.fast: dict[Key, Callable] = {}
        self.disk: dict[str, DiskChoices] = {}

    def pick(self, key: Key, products: dict[str, Callable], identity: str = "", holder: int = 0,
             copying: frozenset = frozenset()) -> tuple[str | None, Callable | None]:
        """For a call of `key`: (None, the product) where the choice is made (before, or now from disk, or
        `products` holds one candidate), else (name, product) of the candidate this call runs for the trial; the
        caller times that call and hands its time to `record` (or runs it through `timed`). `products`: name ->
        product in tie-break order, the same on every call of the key. `copying`: the candidates that copy the
        calling module's (`holder`, its id) weights (`trials.Table.next_call_for`): (trials.SKIP, None) where this
        call runs the baseline, untimed."""
        with self.lock:
            if key in self.fast:
                return None, self.fast[key]
            if key not in self.trials:
                disk = self._disk(identity)
                choice = disk.choice(key, products) if disk else None
                if choice is None and len(products) == 1:
                    choice = Choice(next(iter(products)), {}, source="only candidate")
                if choice is not None:
                    self.settle(key, choice, products)
                    return None, self.fast[key]
            name = self.next_call_for(key, products, holder, copying)
            return name, None if name == trials.SKIP else self.trials[key].products[name]

    def record(self, key: Key, name: str, seconds: float, baseline: str | None = None,
               identity: str = "") -> Choice | None:
        """`trials.Table.record`, the choice also saved to disk where that is on."""
        with self.lock:
            choice = super().record(key, name, seconds, baseline)
            disk = self._disk(identity) if choice is not None else None
            if disk:
                disk.save(key, choice)
            return choice

    def decided(self, key: Key, choice: Choice, products: dict[str, Callable]) -> None:
        self.fast[key] = products[choice.path]

    def _disk(self, identity: str) -> DiskChoices | None:
        if os.environ.get(CACHE_SWITCH, "0") != "1":
            return None
        if identity not in self.disk:
            self.disk[identity] = DiskChoices(identity)
        return self.disk[identity]

    def clear(self) -> None:
        with self.lock:
            super().clear()
            self.fast.clear()

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

