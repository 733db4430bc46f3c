"""The soak test's injected faults (hf_paged/bench/soak_faults.py): every fault point names a real callable, a fault
fires on the chosen call only inside a step of the driver, is caught and counted, and leaves the callable as it was."""
import importlib
import random

import pytest

from hf_paged.bench import soak_faults
from hf_paged.bench.soak_check import Soak


class Target:
    calls: list = []

    def work(self, tag):
        Target.calls.append(tag)
        return tag


class Driver:
    """An LLM stand-in: each step calls Target.work twice."""

    def step(self):
        return [Target().work("a"), Target().work("b")]


POINT = (__name__, "Target.work")


def test_every_point_is_a_callable_of_the_engine():
    for module_name, path in soak_faults.POINTS + soak_faults.STATE_POINTS:
        owner_name, _, name = path.rpartition(".")
        owner = importlib.import_module(module_name)
        owner = getattr(owner, owner_name) if owner_name else owner
        assert callable(getattr(owner, name)), (module_name, path)
    assert len(set(soak_faults.POINTS)) == len(soak_faults.POINTS)


@pytest.mark.parametrize("when, error, calls", [
    ("before", soak_faults.InjectedFault("x"), ["a", "b", "a", "b"]),  # the 3rd call from step 1 never ran
    ("after", KeyboardInterrupt(), ["a", "b", "a", "b", "a"]),  # it ran, then the step failed
])
def test_a_fault_fires_once_on_its_call_and_is_taken_off(when, error, calls):
    original = Target.__dict__["work"]
    Target.calls = []
    faults = soak_faults.Faults(random.Random(0), left=0, points=[POINT])
    faults.current = soak_faults.Fault(POINT, at=3, when=when, error=error, start=1)
    faults._install()
    Target().work("outside a step")  # not counted: only calls inside the driver's steps are
    assert faults.step(Driver(), 0) == ["a", "b"]  # before the fault's start step
    assert faults.step(Driver(), 1) == ["a", "b"]
    assert faults.step(Driver(), 2) == []  # the fault fired: caught, the step gave nothing
    assert Target.calls == ["outside a step"] + calls
    assert Target.__dict__["work"] is original and faults.current is None
    assert faults.step(Driver(), 3) == ["a", "b"]
    soak = Soak()
    assert faults.finish(soak) == [f"Target.work {when} {type(error).__name__}"]
    assert soak.counts["faults_hit"] == soak.counts["fault_rounds"] == 1


def test_another_error_is_not_swallowed():
    faults = soak_faults.Faults.draw(random.Random(1), [POINT])

    class Broken:
        def step(self):
            raise ValueError("a real failure")

    with pytest.raises(ValueError):
        faults.step(Broken(), 10**6)
    faults.uninstall()
    assert Target.__dict__["work"].__name__ == "work" and Target.__dict__["work"].__qualname__ == "Target.work"
