"""Engine settings. The same keys are accepted by `LLM(...)` and by `generate(cache_config={...})`."""
from __future__ import annotations

import dataclasses
import logging
import numbers
from dataclasses import dataclass, field, fields

import torch

logger = logging.getLogger("hf_paged")

GiB = 1 << 30
SEED_LIMIT = 1 << 64  # torch generators take seeds in [0, 2**64)


class InputTypeError(TypeError, ValueError):
    """A value of the wrong type. A TypeError, and also a ValueError, so `except ValueError` catches every bad
    input the engine refuses up front."""


def is_integer(value) -> bool:
    """True for int and numpy / torch integer scalars; False for bool (True is not a token id nor a count)."""
    if type(value) is int:
        return True
    if isinstance(value, bool):
        return False
    if isinstance(value, numbers.Integral):  # int and numpy integers (numpy's bool is not Integral)
        return True
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and value.dtype != torch.bool and not (value.is_floating_point() or value.is_complex())
    return False


# the names `attention_backend` takes (attention/dispatch.py maps each to its implementation)
ATTENTION_BACKENDS = ("auto", "torch", "triton", "cuda", "flash3", "flash2", "flashinfer")


@dataclass(slots=True)
class EngineConfig:
    """What the engine may use.

    Invariants after `validate()`: block_size is a power of two >= 1; the KV pool is sized either by
    `num_blocks` or by the byte budget `kv_cache_memory` (None = a modest device-dependent default,
    see `default_kv_cache_bytes`).
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # > 0: at most this many tokens of one prefill per step
    enable_prefix_caching: bool = True
    preemption_mode: str = "auto"  # "recompute", "swap", or "auto" (cheaper of the two, per request)
    swap_space: int | None = None  # bytes of host swap space; None: 4 GiB beside a GPU, none on CPU
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) or "fp8_e4m3" (per-layer scaled, half/quarter memory)
    # fp8 caches: None (scales calibrated at start, model/kv_calibration.py), a float for every layer's K and V, or
    # one (k_scale, v_scale) per layer; fixed for the engine's life (stored = value / scale, saturated)
    kv_scales: float | list | None = None
    seed: int | None = None
    # decode-only steps as CUDA graphs, one per batch-size bucket (see cuda_graphs.py); only on CUDA devices.
    # True: each bucket is captured on first use; "at_start": all buckets when the engine starts; False: never
    cuda_graphs: bool | str = True
    # models with state layers: prefix hits need the state at the hit point. The state after every
    # `state_checkpoint_interval`-th block of a prompt is kept for later hits, in at most `state_checkpoints`
    # checkpoints (least recently used dropped first; None: 2 x max_num_seqs; 0: no prefix hits on such models).
    # Each holds one sequence's whole state (every state layer).
    state_checkpoints: int | None = None
    state_checkpoint_interval: int = 16

    @classmethod
    def from_dict(cls, options: dict | None) -> "EngineConfig":
        """Build from a `cache_config` dict or `LLM(**kwargs)`; unknown keys are an error, not ignored."""
        options = dict(options or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown hf_paged engine option(s) {unknown}; known options: {sorted(known)}")
        config = cls(**options)
        config.validate()
        return config

    def replace(self, **changes) -> "EngineConfig":
        config = dataclasses.replace(self, **changes)
        config.validate()
        return config

    def validate(self) -> None:
        """Raise InputTypeError (a TypeError and a ValueError) for a value of the wrong type, ValueError for a bad
        value; the message starts with the option's name."""
        def positive(name: str, allow_none: bool = False, low: int = 1) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if not is_integer(value):
                raise InputTypeError(f"{name} must be an integer >= {low}, got {type(value).__name__} {value!r}")
            if value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
            setattr(self, name, int(value))

        def boolean(name: str) -> None:
            if not isinstance(getattr(self, name), bool):
                raise InputTypeError(f"{name} must be True or False, got {getattr(self, name)!r}")

        positive("block_size")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        positive("num_blocks", allow_none=True)
        positive("kv_cache_memory", allow_none=True)
        positive("max_num_seqs")
        positive("max_num_batched_tokens")
        positive("max_model_len", allow_none=True)
        positive("long_prefill_token_threshold", low=0)
        positive("swap_space", allow_none=True, low=0)
        positive("state_checkpoints", allow_none=True, low=0)
        positive("state_checkpoint_interval")
        boolean("enable_chunked_prefill")
        boolean("enable_prefix_caching")
        if self.seed is not None:
            if not is_integer(self.seed):
                raise InputTypeError(f"seed must be an integer in [0, 2**64) or None, got {self.seed!r}")
            self.seed = int(self.seed)  # first: a 0-d tensor compared with 2**64 overflows
            if not 0 <= self.seed < SEED_LIMIT:
                raise ValueError(f"seed must be an integer in [0, 2**64) or None, got {self.seed!r}")
        if self.preemption_mode not in ("recompute", "swap", "auto"):
            raise ValueError(f"preemption_mode must be 'recompute', 'swap' or 'auto', got {self.preemption_mode!r}")
        if self.kv_cache_dtype not in ("auto", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8_e4m3', got {self.kv_cache_dtype!r}")
        if self.kv_scales is not None and self.kv_cache_dtype != "fp8_e4m3":
            raise ValueError("kv_scales applies to kv_cache_dtype='fp8_e4m3' only")
        if not (isinstance(self.cuda_graphs, bool) or self.cuda_graphs == "at_start"):
            raise ValueError(f"cuda_graphs must be True, False or 'at_start', got {self.cuda_graphs!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention_backend {self.attention_backend!r}; choose from {ATTENTION_BACKENDS}")


def available_host_memory() -> int:
    """Bytes of RAM still available (MemAvailable), or total physical memory where /proc is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_swap_bytes(device: torch.device) -> int:
    """Host swap space when none is configured: only worth having beside an accelerator."""
    return 4 * GiB if device.type == "cuda" else 0


def default_kv_cache_bytes(device: torch.device) -> int:
    """A modest default: on CPU at most 2 GiB or 20 % of available RAM, whichever is less;
    on an accelerator 40 % of its currently free memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.4)
    return min(2 * GiB, int(available_host_memory() * 0.2))


__all__ = ["EngineConfig", "InputTypeError", "is_integer", "default_kv_cache_bytes", "available_host_memory", "logger",
           "field"]
