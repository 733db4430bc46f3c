"""Several processes for the offline front doors, under `torchrun` or `accelerate launch`.

Data parallel (a plain model): when every process passed the same inputs to one call, every process serves its share
of them and gets all outputs back, in input order; when the inputs differ (accelerate's `split_between_processes`
gave each its own), every process serves exactly its own, alone. Invariants: each call starts with ONE collective
that every rank reaches (also with no inputs, or invalid ones): the digests of the ranks' inputs, split only when all
are equal; in a split call, prompt i belongs to rank `i % world_size` (strided, so sorted inputs still split their
tokens evenly) and the gathered list holds exactly one result per input index, in input order, on every rank.

Tensor parallel (a model loaded with transformers' `tp_plan="auto"`): the processes serve ONE model together, each
holding its share of the weights and of the KV heads (the engine reads the K/V shapes the model's attention produces,
so its pool holds this rank's heads). Every rank runs every prompt and must take the same scheduling and sampling
decisions in lockstep (each forward pass is a collective): rank 0 draws the sampler seed and every rank takes it, the
pool budget is the smallest of the ranks', and preemption recomputes (the swap cost model measures each process's
own copy speed, which would differ).

A process group that hf_paged started (through accelerate's `PartialState`) is destroyed at interpreter exit.
Nothing here is imported on a single-process run but the standard library, and no collective runs (accelerate and
torch.distributed load only when a multi-process run is seen).
"""
from __future__ import annotations

import atexit
import dataclasses
import enum
import hashlib
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator


@dataclass(slots=True, frozen=True)
class World:
    """This process's place in a multi-process run (`size` 1 when there is none)."""

    rank: int = 0
    size: int = 1
    local_size: int = 1  # processes on this host (they share its memory)

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    def owns(self, index: int) -> bool:
        return index % self.size == self.rank

    def shard(self, items: Iterable[Any]) -> Iterator[tuple[int, Any]]:
        """(index, item) of this rank's share, consuming `items` as it comes."""
        return ((i, item) for i, item in enumerate(items) if self.owns(i))


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def current_world(device: Any = None) -> World:
    """The run this process is part of: torch.distributed's group when initialized, else the launcher's environment
    (WORLD_SIZE > 1), whose process group Accelerate's `PartialState` then starts (gloo on a CPU `device`)."""
    size = _env_int("WORLD_SIZE", 1)
    if size <= 1 and not _dist_initialized():
        return World()
    import torch.distributed as dist

    if not dist.is_initialized():
        from accelerate import PartialState

        PartialState(cpu=getattr(device, "type", device) == "cpu")  # starts the process group
        if dist.is_initialized():
            _destroy_at_exit(dist.group.WORLD)
    rank, size = dist.get_rank(), dist.get_world_size()
    return World(rank, size, max(1, min(size, _env_int("LOCAL_WORLD_SIZE", size))))


def _destroy_at_exit(group: Any) -> None:
    """Destroy the default process group `group` (the one hf_paged started) at interpreter exit, if it still is the
    default group then (the caller may have destroyed it, or replaced it, meanwhile): a gloo group left to the
    interpreter's teardown may abort the process ("terminate called without an active exception")."""
    def destroy() -> None:
        import torch.distributed as dist

        if dist.is_initialized() and dist.group.WORLD is group:
            dist.destroy_process_group()

    atexit.register(destroy)


def _dist_initialized() -> bool:
    if "torch.distributed" not in sys.modules:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def split_world(world: World, read: Callable[[], tuple[Any, Any]]) -> tuple[Any, World]:
    """(this rank's inputs of one call, the world to split them over). `read()` gives (the inputs, what identifies
    them: everything the outputs depend on); in a multi-process `world` every rank tells the others a digest of it in
    one collective, which it reaches also when `read` raises (then it raises after): `world` when every rank has the
    same digest, else a world of one (each rank serves its own inputs). No collective in a single-process world."""
    if not world.is_parallel:
        return read()[0], world
    try:
        inputs, identity = read()
        digest = inputs_digest(identity)
    except Exception:
        _all_equal(world, None)
        raise
    return inputs, (world if _all_equal(world, digest) else World())


def _all_equal(world: World, digest: str | None) -> bool:
    """Whether every rank's digest is this one (None, unknown, equals none): one collective, the same answer on all."""
    import torch.distributed as dist

    digests: list = [None] * world.size
    dist.all_gather_object(digests, digest)
    return digest is not None and all(d == digest for d in digests)


class _NotCanonical(Exception):
    pass


def inputs_digest(value: Any) -> str | None:
    """sha256 of a canonical encoding of `value` (None, bool, numbers, strings, enums, lists, tuples, dicts, tensors /
    arrays, dataclasses, plain objects by their attributes): equal values give equal digests in every process. None
    for anything else (a function, a cycle): such inputs are never split (each rank serves its own, always right)."""
    digest = hashlib.sha256()
    try:
        _encode(value, digest.update, 0)
    except _NotCanonical:
        return None
    return digest.hexdigest()


def _encode(value: Any, out: Callable[[bytes], Any], depth: int) -> None:
    if depth > 64:
        raise _NotCanonical
    if value is None or isinstance(value, (str, bytes, bool, int, float)):
        out(f"{type(value).__name__}:{value!r};".encode())
        return
    if isinstance(value, enum.Enum):  # e.g. the pipeline's return_type
        out(f"{type(value).__module__}.{type(value).__qualname__}.{value.name}(".encode())
        items: Iterable[Any] = [value.value]
    elif isinstance(value, (list, tuple)):
        out(f"{type(value).__name__}[{len(value)}:".encode())
        items = value
    elif isinstance(value, dict):
        out(f"dict{{{len(value)}:".encode())
        items = [part for pair in sorted(value.items(), key=lambda pair: repr(pair[0])) for part in pair]
    elif hasattr(value, "tolist") and hasattr(value, "shape") and hasattr(value, "dtype"):  # a tensor / an array
        out(f"tensor{tuple(value.shape)}{value.dtype}:".encode())
        items = [value.tolist()]
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        out(f"{type(value).__module__}.{type(value).__qualname__}(".encode())
        items = [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
    elif hasattr(value, "__dict__") and not callable(value) and not isinstance(value, type):
        out(f"{type(value).__module__}.{type(value).__qualname__}(".encode())  # e.g. the pipeline's Chat(messages)
        items = [vars(value)]
    else:
        raise _NotCanonical
    for item in items:
        _encode(item, out, depth + 1)
    out(b")")


def gather_in_order(world: World, mine: list[tuple[int, Any]], count: int | None = None) -> list[Any]:
    """Every rank's (index, result) pairs, gathered on every rank and returned as results in input order. With
    `count`, checks that exactly indices 0..count-1 came back. Through torch.distributed itself: accelerate's
    `gather_object` gathers nothing when its state says one process (`PartialState()` without `cpu=True` on a CPU
    host starts the process group and still says so)."""
    if not world.is_parallel:
        pairs = list(mine)
    else:
        import torch.distributed as dist

        gathered: list = [None] * world.size
        dist.all_gather_object(gathered, list(mine))
        pairs = [pair for part in gathered for pair in part]
    pairs.sort(key=lambda pair: pair[0])
    if count is not None and [i for i, _ in pairs] != list(range(count)):
        raise RuntimeError(f"data parallel gather returned indices {[i for i, _ in pairs][:8]}... for {count} inputs")
    return [result for _, result in pairs]


def engine_options(world: World, options: dict | None, device: Any) -> dict:
    """The engine options of one process: the caller's, and without a pool size (`num_blocks` /
    `kv_cache_memory`) in a multi-process run, this process's share of the default budget of its host's memory
    (CPU) or of its device when several processes share it."""
    options = dict(options or {})
    if not world.is_parallel or options.get("num_blocks") is not None or options.get("kv_cache_memory") is not None:
        return options
    import torch

    from .config import default_kv_cache_bytes

    device = torch.device(device)
    sharing = world.local_size if device.type == "cpu" else _processes_per_device(world)
    if sharing > 1:
        options["kv_cache_memory"] = max(1, default_kv_cache_bytes(device) // sharing)
    return options


def _processes_per_device(world: World) -> int:
    """Processes of this host per accelerator (each has its own unless there are more processes than devices)."""
    import torch

    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return max(1, -(-world.local_size // devices)) if devices else world.local_size


def tensor_parallel_size(model: Any) -> int:
    """How many processes share this model's weights (transformers' `tp_plan`); 1 for a plain model."""
    return int(getattr(model, "_tp_size", None) or 1)


def plan_processes(model: Any, options: dict | None, device: Any, data_parallel: bool = True) -> tuple[World, dict]:
    """(the data-parallel world to split prompts over, this process's engine options) for a model on `device`."""
    if tensor_parallel_size(model) > 1:
        return World(), tensor_parallel_options(options, device)
    world = current_world(device) if data_parallel else World()
    return world, engine_options(world, options, device)


def tensor_parallel_options(options: dict | None, device: Any) -> dict:
    """The engine options every rank of a tensor-parallel model runs with, agreed through collectives: the sampler
    seed (rank 0's, drawn there when unset), the pool budget (the smallest of the ranks' shares), recompute preemption unless the caller chose."""
    import torch
    import torch.distributed as dist

    world = current_world(device)
    options = engine_options(world, options, device)
    seed = [options.get("seed")]
    if seed[0] is None:
        seed = [int(torch.randint(0, 2**62, ()).item())]
    dist.broadcast_object_list(seed, src=0)  # rank 0 decides
    options["seed"] = seed[0]
    if options.get("num_blocks") is None and options.get("kv_cache_memory") is None:
        from .config import default_kv_cache_bytes

        options["kv_cache_memory"] = default_kv_cache_bytes(torch.device(device))
    for key in ("num_blocks", "kv_cache_memory"):
        if options.get(key) is not None:
            values: list = [None] * world.size
            dist.all_gather_object(values, options[key])
            options[key] = min(values)
    options.setdefault("preemption_mode", "recompute")
    return options
