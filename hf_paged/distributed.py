"""Several processes for the offline front doors, under `torchrun` or `accelerate launch`.

Data parallel (a plain model): every process serves its share of one call's prompts and every process gets all
outputs back, in input order. Invariants: prompt i belongs to rank `i % world_size` (strided, so sorted inputs still
split their tokens evenly); the gathered list holds exactly one result per input index, in input order, on every rank.

Tensor parallel (a model loaded with transformers' `tp_plan="auto"`): the processes serve ONE model together, each
holding its share of the weights and of the KV heads (the engine reads the K/V shapes the model's attention produces,
so its pool holds this rank's heads). Every rank runs every prompt and must take the same scheduling and sampling
decisions in lockstep (each forward pass is a collective): rank 0 draws the sampler seed and every rank takes it, the
pool budget is the smallest of the ranks', and preemption recomputes (the swap cost model measures each process's
own copy speed, which would differ).

Nothing here is imported on a single-process run but `os` and `sys` (accelerate and torch.distributed load only
when a multi-process run is seen).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Iterator


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
    from accelerate import PartialState

    PartialState(cpu=getattr(device, "type", device) == "cpu")  # starts the process group unless it runs already
    rank, size = dist.get_rank(), dist.get_world_size()
    return World(rank, size, max(1, min(size, _env_int("LOCAL_WORLD_SIZE", size))))


def _dist_initialized() -> bool:
    if "torch.distributed" not in sys.modules:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def gather_in_order(world: World, mine: list[tuple[int, Any]], count: int | None = None) -> list[Any]:
    """Every rank's (index, result) pairs, gathered on every rank and returned as results in input order. With
    `count`, checks that exactly indices 0..count-1 came back."""
    if not world.is_parallel:
        pairs = list(mine)
    else:
        from accelerate.utils import gather_object

        pairs = gather_object(list(mine))
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
