"""The measured choice of few-row linear products (hf_paged/model/linear_choice.py, small_linear._measured_linear):
a trial over real calls keeps the faster path, measures each (shape, dtype, row bucket, thread count) once, honours the
overrides and the optional disk cache. Speeds are never measured here: fake products advance a fake clock by fixed
costs."""
import json
import os
import stat
import threading

import pytest
import torch

from hf_paged import trials
from hf_paged.model import SmallBatchLinears, linear_choice, small_linear
from hf_paged.model.linear_choice import BUCKET_OF, BUCKETS, TABLE, Key
from hf_paged.model.small_linear import load_small_gemm
from hf_paged.trials import SAMPLES, Trial


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Fakes:
    """Fake products: each runs the real product it stands for (so results stay right) and advances the fake clock
    by its cost; `calls` counts each one's runs, `probes` the trials started."""

    def __init__(self, monkeypatch, costs: dict[str, float]):
        self.clock, self.costs, self.probes, self.made, self.barrier = FakeClock(), dict(costs), 0, 0, None
        self.calls = dict.fromkeys(costs, 0)
        monkeypatch.setattr(trials, "clock", self.clock)
        self.real = small_linear.candidates
        monkeypatch.setattr(small_linear, "candidates", self.candidates)
        fakes = self

        class CountedTrial(Trial):
            def __post_init__(self):
                fakes.probes += 1
                super().__post_init__()
        monkeypatch.setattr(trials, "Trial", CountedTrial)

    def candidates(self, kernel):
        """Made on each call that found no choice (before the table's lock); `barrier`: wait for other threads."""
        self.made += 1
        if self.barrier is not None:
            self.barrier.wait(timeout=10)
        real = self.real(kernel)

        def fake(name):
            def run(rows, weight, bias):
                self.calls[name] += 1
                self.clock.now += self.costs[name]
                return real[name](rows, weight, bias)
            return run
        return {name: fake(name) for name in self.costs if name in real}


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    for name in ("HF_PAGED_SMALL_LINEARS", "HF_PAGED_SMALL_GEMM", linear_choice.CACHE_SWITCH):
        monkeypatch.delenv(name, raising=False)
    load_small_gemm.cache_clear()
    TABLE.clear()
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    load_small_gemm.cache_clear()
    TABLE.clear()


def run(net, x):
    with SmallBatchLinears(net).active(), torch.inference_mode():
        return net(x)


def settle(net, x, calls: int = 1):
    """`calls` calls, then more until no trial is left (at most 100); checks each call's result on the way."""
    want = torch.nn.functional.linear(x, net.weight, net.bias)
    for i in range(100):
        if i >= calls and not TABLE.trials:
            return want
        torch.testing.assert_close(run(net, x), want, rtol=1e-5, atol=1e-5)
    raise AssertionError("the trial never ended")


def test_buckets_cover_every_row_count_with_the_smallest_power_of_two_at_or_above_it():
    assert [BUCKET_OF[m] for m in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64, 65, 128)] == \
        [1, 2, 4, 4, 8, 8, 16, 16, 32, 64, 64, 128, 128]
    assert BUCKETS[-1] == small_linear.KERNEL_MAX_ROWS == len(BUCKET_OF) - 1


@pytest.mark.parametrize("winner", ["kernel", "w_xt", "f_linear"])
def test_the_trial_picks_the_fastest_and_calls_then_run_only_it(monkeypatch, winner):
    costs = {"kernel": 5e-3, "w_xt": 4e-3, "f_linear": 6e-3}
    costs[winner] = 1e-3
    fakes = Fakes(monkeypatch, costs)
    torch.manual_seed(0)
    net = torch.nn.Linear(48, 40)
    x = torch.randn(3, 48)
    want = settle(net, x)  # every call of the trial ran one candidate, on the call's own rows: results right
    assert fakes.probes == 1
    assert fakes.calls == {n: 1 + (SAMPLES if n == winner else 1) for n in costs}  # the losers dropped early
    (entry,) = small_linear.small_linear_choices()
    assert entry["path"] == winner and entry["shape"] == [40, 48] and entry["rows"] == 4
    assert entry["source"] == "measured" and entry["us"] == {name: cost * 1e6 for name, cost in costs.items()}
    before = dict(fakes.calls)
    for rows in (3, 4):  # the same bucket: the winner only, found with one lookup
        torch.testing.assert_close(run(net, x[:rows]), want[:rows], rtol=1e-5, atol=1e-5)
    assert fakes.probes == 1 and fakes.made == fakes.calls[winner] - 2 + sum(
        before[n] for n in costs if n != winner)  # candidates made only on the trial's calls
    assert {name: fakes.calls[name] - before[name] for name in costs} == {n: 2 * (n == winner) for n in costs}
    assert f"40x48 float32 threads={torch.get_num_threads()}: 4 {winner}" in small_linear.small_linear_status()


def test_choices_are_keyed_by_shape_bucket_and_thread_count(monkeypatch):
    fakes = Fakes(monkeypatch, {"kernel": 2e-3, "w_xt": 1e-3, "f_linear": 3e-3})
    torch.set_num_threads(1)
    a, same_shape, other = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8), torch.nn.Linear(16, 12)
    while not TABLE.fast:  # two layers of one shape take turns in one trial
        run(a, torch.randn(3, 16))
        run(same_shape, torch.randn(4, 16))
    assert fakes.probes == 1 and len(TABLE.fast) == 1 and not TABLE.trials
    settle(a, torch.randn(5, 16))  # bucket 8
    settle(other, torch.randn(3, 16))  # another shape
    assert fakes.probes == 3
    torch.set_num_threads(2)
    settle(a, torch.randn(3, 16))  # another thread count
    assert fakes.probes == 4
    run(a.double(), torch.randn(3, 16, dtype=torch.float64))  # not fp32: F.linear, nothing measured
    assert fakes.probes == 4
    keys = sorted((e["shape"][0], e["rows"], e["threads"]) for e in small_linear.small_linear_choices())
    assert keys == [(8, 4, 1), (8, 4, 2), (8, 8, 1), (12, 4, 1)]
    assert set(TABLE.fast) == {Key((8, 16), torch.float32, 4, 1, True), Key((8, 16), torch.float32, 8, 1, True),
                               Key((12, 16), torch.float32, 4, 1, True), Key((8, 16), torch.float32, 4, 2, True)}
    assert not TABLE.trials
    run(a.float(), torch.randn(200, 16))  # beyond KERNEL_MAX_ROWS: a key of its own, no kernel (onednn_linear)
    assert fakes.probes == 5 and set(TABLE.trials) == {Key((8, 16), torch.float32, 256, 2, False)}


def test_the_trial_runs_each_calls_own_rows_and_draws_no_random_numbers(monkeypatch):
    seen = []
    fakes = Fakes(monkeypatch, {"kernel": 2e-3, "w_xt": 1e-3, "f_linear": 3e-3})
    real = fakes.candidates
    monkeypatch.setattr(small_linear, "candidates", lambda kernel: {
        name: (lambda f: lambda rows, w, b: seen.append(rows.shape[0]) or f(rows, w, b))(f)
        for name, f in real(kernel).items()})
    net = torch.nn.Linear(16, 8)
    x = torch.randn(2, 5, 16).transpose(0, 1)[:, 0]  # 5 rows, strided
    state = torch.random.get_rng_state()
    settle(net, x)
    assert torch.equal(state, torch.random.get_rng_state())
    assert set(seen) == {5} and len(seen) == sum(fakes.calls.values())  # one product per call: no extra runs


def test_without_the_kernel_it_chooses_between_the_others(monkeypatch):
    monkeypatch.setenv("HF_PAGED_SMALL_GEMM", "0")
    fakes = Fakes(monkeypatch, {"kernel": 1e-4, "w_xt": 3e-3, "f_linear": 2e-3})
    net = torch.nn.Linear(16, 8)
    settle(net, torch.randn(2, 16))
    (entry,) = small_linear.small_linear_choices()
    assert entry["path"] == "f_linear" and set(entry["us"]) == {"w_xt", "f_linear"} and not entry["kernel_available"]
    assert fakes.calls["kernel"] == 0
    assert "(no native kernel: disabled by HF_PAGED_SMALL_GEMM=0)" in small_linear.small_linear_status()


@pytest.mark.parametrize("setting, used", [("0", None), ("kernel", "kernel"), ("w_xt", "w_xt")])
def test_the_environment_overrides_the_measurement(monkeypatch, setting, used):
    monkeypatch.setenv("HF_PAGED_SMALL_LINEARS", setting)
    fakes = Fakes(monkeypatch, {"kernel": 3e-3, "w_xt": 3e-3, "f_linear": 1e-3})  # measured: F.linear would win
    calls = []
    kernel = load_small_gemm()
    real_kernel, real_w_xt = type(kernel).__call__, small_linear._w_xt
    monkeypatch.setattr(type(kernel), "__call__", lambda self, *a: calls.append("kernel") or real_kernel(self, *a))
    monkeypatch.setattr(small_linear, "_w_xt", lambda *a: calls.append("w_xt") or real_w_xt(*a))
    net = torch.nn.Linear(16, 8)
    x = torch.randn(3, 16)
    torch.testing.assert_close(run(net, x), torch.nn.functional.linear(x, net.weight, net.bias))
    assert fakes.probes == 0 and small_linear.small_linear_choices() == []
    assert calls == ([used] if used else [])
    assert small_linear.small_linear_status().startswith(
        {"0": "off (HF_PAGED_SMALL_LINEARS=0)", "kernel": "native kernel (forced", "w_xt": "W @ x^T (forced"}[setting])
    assert (SmallBatchLinears(net).modules == []) == (setting == "0")


def test_an_unknown_setting_is_warned_about_and_measured(monkeypatch, caplog):
    monkeypatch.setenv("HF_PAGED_SMALL_LINEARS", "fastest-please")
    fakes = Fakes(monkeypatch, {"kernel": 3e-3, "w_xt": 1e-3, "f_linear": 2e-3})
    run(torch.nn.Linear(16, 8), torch.randn(3, 16))
    assert fakes.probes == 1 and "fastest-please" in caplog.text


def test_two_threads_share_one_trial(monkeypatch):
    fakes = Fakes(monkeypatch, {"kernel": 3e-3, "w_xt": 1e-3, "f_linear": 2e-3})
    net = torch.nn.Linear(16, 8)
    start = threading.Barrier(2)
    fakes.barrier = threading.Barrier(2)  # both threads found no choice before either starts the trial
    errors = []

    def work():
        try:
            start.wait()
            run(net, torch.randn(3, 16))  # both made candidates before either started the trial
            fakes.barrier = None
            start.wait()
            settle(net, torch.randn(3, 16), calls=10)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)
    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert fakes.probes == len(small_linear.small_linear_choices()) == 1 and not TABLE.trials


def test_choices_persist_on_disk_only_when_asked(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_PAGED_CACHE_DIR", str(tmp_path / "cache"))
    fakes = Fakes(monkeypatch, {"kernel": 3e-3, "w_xt": 1e-3, "f_linear": 2e-3})
    net = torch.nn.Linear(16, 8)
    settle(net, torch.randn(3, 16))
    assert fakes.probes == 1 and not list((tmp_path / "cache").glob("*.json"))  # off by default: nothing written
    TABLE.clear()
    monkeypatch.setenv(linear_choice.CACHE_SWITCH, "1")
    settle(net, torch.randn(3, 16))
    assert fakes.probes == 2
    (saved,) = (tmp_path / "cache").glob("small_linear_choices_*.json")
    assert stat.S_IMODE(os.stat(saved).st_mode) == 0o600
    TABLE.clear()
    fakes.costs.update(w_xt=9e-3)  # would change the choice, were it measured again
    run(net, torch.randn(3, 16))
    (entry,) = small_linear.small_linear_choices()
    assert fakes.probes == 2 and entry["source"] == "disk" and entry["path"] == "w_xt"
    TABLE.clear()
    monkeypatch.setenv("HF_PAGED_SMALL_GEMM", "0")  # another key (no kernel): measured, then saved beside
    load_small_gemm.cache_clear()
    settle(net, torch.randn(3, 16))
    assert fakes.probes == 3 and small_linear.small_linear_choices()[0]["path"] == "f_linear"
    assert len(saved.read_text().split("kernel=")) == 3
    entry = "8x16 float32 rows<=4 threads=%d kernel=0" % torch.get_num_threads()
    for probes, damaged in enumerate([{"path": "kernel", "seconds": {"w_xt": 1, "f_linear": 2}},  # not a candidate
                                      {"path": "w_xt", "seconds": {"w_xt": "fast", "f_linear": 2}}, [], "w_xt"], 4):
        saved.write_text(json.dumps({entry: damaged}))  # measured again, never trusted
        TABLE.clear()
        run(net, torch.randn(3, 16))
        assert fakes.probes == probes


def test_a_real_trial_picks_one_of_its_candidates_and_keeps_results():
    """No timing asserted: only that a real trial (real clock, real products) ends in a valid, consistent choice."""
    torch.manual_seed(0)
    net = torch.nn.Linear(64, 96)
    settle(net, torch.randn(6, 64))
    (entry,) = small_linear.small_linear_choices()
    (choice,) = TABLE.choices.values()
    assert entry["path"] == choice.path and choice.path in choice.seconds
    assert set(entry["us"]) == {"kernel", "w_xt", "wt_copy", "onednn", "f_linear"} and entry["probe_ms"] > 0
    assert not TABLE.trials


def test_a_call_that_chose_f_linear_runs_it_on_the_input_as_given(monkeypatch):
    """F.linear chosen: later calls hand it their input directly (no reshape, no checks), any shape or autograd."""
    monkeypatch.setattr(trials, "clock", FakeClock())  # every call takes no time: F.linear stays
    net = torch.nn.Linear(16, 8)
    x = torch.randn(2, 2, 16)
    settle(net, x)
    assert list(TABLE.fast.values()) == [torch.nn.functional.linear]
    checks = []
    takes = small_linear._kernel_takes
    monkeypatch.setattr(small_linear, "_kernel_takes", lambda *a: checks.append(1) or takes(*a))
    with SmallBatchLinears(net).active():
        out = net(x.requires_grad_())
        assert out.grad_fn is not None and torch.equal(out, torch.nn.functional.linear(x, net.weight, net.bias))
    assert not checks  # F.linear needs none of the kernel's checks


@pytest.mark.parametrize("winner", ["kernel", "w_xt", "f_linear"])
def test_every_input_layout_gets_f_linears_shape_and_values(monkeypatch, winner):
    costs = {"kernel": 5e-3, "w_xt": 4e-3, "f_linear": 6e-3}
    costs[winner] = 1e-3
    Fakes(monkeypatch, costs)
    net = torch.nn.Linear(16, 8)
    for _ in range(3 * (SAMPLES + 1)):  # during the trials (every candidate meets every layout) and after them
        for x in (torch.randn(16), torch.randn(3, 4, 16), torch.randn(16, 3).t(), torch.randn(2, 32)[:, ::2]):
            want = torch.nn.functional.linear(x, net.weight, net.bias)
            got = run(net, x)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert {e["path"] for e in small_linear.small_linear_choices()} == {winner}
