"""The parameter names of a forward, read once per function: `inspect.signature` costs tens of microseconds a call,
and the generate take-over asks about the same few forwards on every call."""
from __future__ import annotations

import functools
import inspect


def parameter_names(forward) -> frozenset[str]:
    """Names of the parameters `forward` (a function, or a method bound to its object) takes, as
    `inspect.signature(forward).parameters` lists them (a bound method's own first parameter included: no caller
    asks about it). Anything that is not a plain function or method is read afresh each time."""
    function = getattr(forward, "__func__", forward)
    if inspect.isfunction(function):
        return _of_function(function)
    return frozenset(inspect.signature(forward).parameters)


@functools.lru_cache(maxsize=1024)
def _of_function(function) -> frozenset[str]:
    return frozenset(inspect.signature(function).parameters)
