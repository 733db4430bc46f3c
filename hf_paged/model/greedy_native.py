"""The native passes of the greedy LM head (cpu/greedy_head.c), built on first use (`hf_paged/native.py`):
`greedy_pick` (the bf16 screen's pick), `screen_i8` and `greedy_pick_i8` (the int8 screen and its pick). The
arguments and why the picks are exact: the C source and `greedy_head`."""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .. import native
from .int8_head import Int8Head

SOURCE = Path(__file__).with_name("cpu") / "greedy_head.c"
SWITCH = "HF_PAGED_GREEDY_HEAD"
_status: dict[str, str] = {}


class Picker:
    """`greedy_pick` (and `pick_i8`: `greedy_pick_i8`, `screen_i8`) of cpu/greedy_head.c."""

    def __init__(self, path: Path):
        library = ctypes.CDLL(str(path))
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self.fn, self.fn8, self.screen8 = library.greedy_pick, library.greedy_pick_i8, library.screen_i8
        self.fn.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64]
        self.fn8.argtypes = [ptr, ptr, ptr, i64, ptr, ptr, ptr, ctypes.c_double, ptr, ptr, ptr, ptr, i64, i64, i64]
        self.screen8.argtypes = [ptr, ptr, ptr, i64, ptr, i64, i64, i64]
        for fn in (self.fn, self.fn8, self.screen8):
            fn.restype = None

    @torch.compiler.disable  # raw pointers: never traced
    def __call__(self, screen: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor,
                 slack: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """screen [m, n] bf16 contiguous, rows [m, k] fp32 (rows contiguous), weight [n, k] fp32 contiguous, slack [m]
        float64 -> (picks [m] int64, their exact logits [m] fp32, exact logits computed per row [m] int64)."""
        m, k = rows.shape
        token = torch.empty(m, dtype=torch.int64)
        value = torch.empty(m, dtype=torch.float32)
        seen = torch.empty(m, dtype=torch.int64)
        self.fn(screen.data_ptr(), rows.data_ptr(), rows.stride(0), weight.data_ptr(), slack.data_ptr(),
                token.data_ptr(), value.data_ptr(), seen.data_ptr(), m, weight.shape[0], k)
        return token, value, seen

    @torch.compiler.disable
    def pick_i8(self, copy: Int8Head, rows: torch.Tensor, weight: torch.Tensor, slack: torch.Tensor,
                rel: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The same from the int8 copy `copy` of `weight` (fp32, or bf16: then the picks are the first argmax of
        bf16-rounded logits, `value` holds those, `rows` are the bf16 rows as fp32 and `rel` widens the floor for
        the rounding: greedy_head.BF16_REL); also returns the screen [m, n] fp32."""
        m, k = rows.shape
        n = weight.shape[0]
        screen = torch.empty(m, n, dtype=torch.float32)
        token = torch.empty(m, dtype=torch.int64)
        value = torch.empty(m, dtype=torch.float32)
        seen = torch.empty(m, dtype=torch.int64)
        fp32 = weight.dtype is torch.float32
        self.fn8(copy.q.data_ptr(), copy.scales.data_ptr(), rows.data_ptr(), rows.stride(0),
                 weight.data_ptr() if fp32 else None, None if fp32 else weight.data_ptr(), slack.data_ptr(),
                 rel, screen.data_ptr(), token.data_ptr(), value.data_ptr(), seen.data_ptr(),
                 m, n, k)
        return token, value, screen

    @torch.compiler.disable
    def screen_i8(self, copy: Int8Head, rows: torch.Tensor) -> torch.Tensor:
        """The int8 screen alone [m, n] fp32 (checking its bound)."""
        m, k = rows.shape
        n = copy.q.shape[0]
        screen = torch.empty(m, n, dtype=torch.float32)
        self.screen8(copy.q.data_ptr(), copy.scales.data_ptr(), rows.data_ptr(), rows.stride(0), screen.data_ptr(),
                     m, n, k)
        return screen


@functools.lru_cache(maxsize=1)
def load_picker() -> Picker | None:
    picker, _status["reason"] = native.load(SOURCE, SWITCH, Picker)
    return picker


def native_status() -> str:
    """Why the native pass is not loaded (after `load_picker`)."""
    return _status.get("reason", "not built yet")
