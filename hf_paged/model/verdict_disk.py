"""The start-up check's verdict, the padding probe's answer (`probe`) and the attention modules' K/V shapes
(`spec.module_kv_shape`), kept on disk for the next process.

Each runs forwards of the whole model: on a Qwen2.5-0.5B-sized fp32 model on the 2-core EPYC the check took 2.1 s,
the padding probe 0.7 s and the shapes' forward 0.25 s of a first `generate` call, in every new process, for answers
that only the code and the model's shape decide. So each answer (of the check: a pass) is written to a small file,
and a later process whose `identity` is the same reads it instead of running the forwards again.

Invariants:
- `identity` covers everything the answer depends on but the weights' values (which the in-process verdict ignores
  too): the versions of hf_paged (its source files), transformers and torch; the CPU (`native.cpu_identity`: native
  kernels take other code paths on other CPUs); every field of the model's config and each config's attention
  implementation, with the code of the function registered for it; the classes of all its modules and the code of
  every function and method in the Python modules that define them (a function patched into such a module at run
  time counts, as does a function it wraps or closes over); the names, shapes and dtypes of its parameters and
  buffers (and their tensor classes); hf_paged's environment switches (`HF_PAGED_*`: they choose the kernels the
  check's forwards run); and the caller's own key (backend, dtype, device, mode, ...).
- A model whose state modules run substitute forwards (`state_fast`, chosen per process by timing) keeps no check
  verdict: another process may run another combination of them.
- A model with something attached to one instance only (a module whose instance holds its own `forward`, a module
  with forward hooks, global module hooks) has no identity: it is checked in every process, as before.
- Only passes are kept: a refusal is made again, with its message. A file that cannot be read, parsed or trusted
  counts as absent; writes are atomic (a concurrent reader sees the old file or the new one), failures only cost a
  check. Files live in `native.cache_dir()`, checked like the native builds (`native.private_folder`, only
  `native.trusted_file`s are read).
- `HF_PAGED_CHECK_CACHE=0` turns reading and writing off (the test suite does, but for this module's own tests).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import sys
import tempfile
import types
from pathlib import Path

import torch

from .. import native

logger = logging.getLogger("hf_paged")

SWITCH = "HF_PAGED_CHECK_CACHE"
PACKAGE = Path(__file__).resolve().parent.parent


def enabled() -> bool:
    return os.environ.get(SWITCH, "1").strip().lower() not in ("0", "off", "false", "no")


@functools.lru_cache(maxsize=1)
def _library_identity() -> str:
    """hf_paged's source files (Python and native), transformers', torch's versions, the CPU."""
    import transformers

    digest = hashlib.sha256()
    for path in sorted(p for p in PACKAGE.rglob("*") if p.suffix in (".py", ".c", ".cpp", ".h", ".cu")):
        digest.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes())
    return f"hf_paged {digest.hexdigest()} transformers {transformers.__version__} torch {torch.__version__} " \
           f"cpu {native.cpu_identity()}"


def _switches() -> str:
    """hf_paged's environment switches (they choose which kernels and paths the check's forwards run)."""
    return repr(sorted((name, value) for name, value in os.environ.items()
                       if name.startswith("HF_PAGED_") and name not in (SWITCH, "HF_PAGED_CACHE_DIR")))


def _constant(value) -> bytes:
    """A code object's constant, written the same in every process (a frozenset's order follows string hashes, which
    differ between processes; marshal's output depends on reference counts)."""
    if isinstance(value, types.CodeType):
        return _code_bytes(value)
    if isinstance(value, (frozenset, set)):
        return b"{" + b",".join(sorted(_constant(v) for v in value)) + b"}"
    if isinstance(value, tuple):
        return b"(" + b",".join(_constant(v) for v in value) + b")"
    return repr(value).encode()


def _code_bytes(code: types.CodeType) -> bytes:
    return b"\0".join([code.co_code, " ".join(code.co_names).encode(), " ".join(code.co_varnames).encode(),
                       _constant(code.co_consts)])


def _code(function, depth: int = 0) -> bytes:
    """The bytecode and constants of `function`, of what it wraps (`__wrapped__`) and of functions in its closure."""
    function = getattr(function, "__func__", function)  # classmethod / staticmethod / bound method
    if depth > 3:
        return b"..."
    code = getattr(function, "__code__", None)
    parts = [repr(type(function)).encode() if code is None else _code_bytes(code)]
    wrapped = getattr(function, "__wrapped__", None)  # also of a wrapper without code of its own (lru_cache)
    if wrapped is not None:
        parts.append(_code(wrapped, depth + 1))
    for cell in getattr(function, "__closure__", None) or ():
        try:
            content = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if callable(content) and hasattr(getattr(content, "__func__", content), "__code__"):
            parts.append(_code(content, depth + 1))
    return b"\0".join(parts)


def _module_code(name: str) -> bytes:
    """The code of every function in Python module `name` and of every method of the classes it defines."""
    module = sys.modules.get(name)
    if module is None:
        return b"?" + name.encode()
    parts = []
    for attribute, value in sorted(vars(module).items()):
        if isinstance(value, types.FunctionType) or (callable(value) and not isinstance(value, (type, types.ModuleType))
                                                     and "__wrapped__" in getattr(value, "__dict__", {})):
            parts.append(attribute.encode() + b"=" + _code(value))
        elif isinstance(value, type) and value.__module__ == name:
            for member, method in sorted(vars(value).items()):
                inner = getattr(method, "__func__", getattr(method, "fget", method))
                if isinstance(inner, types.FunctionType):
                    parts.append(f"{attribute}.{member}=".encode() + _code(inner))
    return b"\0".join(parts)


def _attached(model: torch.nn.Module) -> bool:
    """Whether anything is attached to one module instance only (or to every module, by global hooks)."""
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any("forward" in vars(m) or m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def identity(model: torch.nn.Module, configs: list, key: tuple) -> str | None:
    """The digest every answer about `model` under `key` is stored by (module doc), or None: none (something is
    attached to an instance, or the model could not be described: the answers are then found as before)."""
    try:
        return None if _attached(model) else _digest(model, configs, key)
    except Exception as error:  # noqa: BLE001 - a config that cannot be written out, an odd module: no disk answer
        logger.debug("hf_paged: no start-up identity for %s: %r", type(model).__name__, error)
        return None


def _digest(model: torch.nn.Module, configs: list, key: tuple) -> str:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = model.config.to_json_string(use_diff=False)
    digest = hashlib.sha256()
    digest.update(_library_identity().encode() + b"\0" + _switches().encode() + b"\0" + config.encode() + b"\0"
                  + repr(key).encode())
    for c in configs:
        implementation = getattr(c, "_attn_implementation", None)
        digest.update(repr(implementation).encode())
        if isinstance(implementation, str) and implementation in ALL_ATTENTION_FUNCTIONS:
            digest.update(_code(ALL_ATTENTION_FUNCTIONS[implementation]))
    classes = {type(m) for m in model.modules()}
    for cls in sorted(classes, key=lambda c: (c.__module__, c.__qualname__)):
        digest.update(f"{cls.__module__}.{cls.__qualname__}".encode())
    for name in sorted({c.__module__ for cls in classes for c in cls.__mro__ if c.__module__ != "builtins"}):
        digest.update(name.encode() + b"\0" + _module_code(name))
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:  # a tensor subclass (torchao) counts
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype} {type(tensor).__qualname__}".encode())
    return digest.hexdigest()


def folder() -> Path:
    return native.cache_dir() / "verdicts"


def _path(kind: str, digest: str) -> Path:
    return folder() / f"{kind}_{digest[:32]}.json"


def load(kind: str, digest: str | None):
    """The answer stored for (`kind`, `digest`), or None: none, unreadable, or the cache is off."""
    if digest is None or not enabled():
        return None
    path = _path(kind, digest)
    try:
        native.check_folder(path.parent)
        if not native.trusted_file(path):
            return None
        data = json.loads(path.read_text())
        return data["answer"] if isinstance(data, dict) and data.get("identity") == digest else None
    except (OSError, ValueError, KeyError, native.UnsafeCacheError):
        return None


def save(kind: str, digest: str | None, answer) -> None:
    """Store `answer` (JSON) for (`kind`, `digest`); failures only cost a check in the next process."""
    if digest is None or not enabled():
        return
    path, tmp = _path(kind, digest), None
    try:
        folder = native.private_folder(path.parent)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".json")  # mode 0600
        with os.fdopen(fd, "w") as f:
            json.dump({"identity": digest, "answer": answer}, f)
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError, native.UnsafeCacheError) as error:
        logger.debug("hf_paged: start-up verdict not saved to %s: %s", path, error)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
