"""Trials in the model's own calls (linear_choice.Trial) for the bf16 packed products and the greedy LM head: each
trial call gives the caller what it would get anyway, the choice follows the timed calls, and a choice of the usual
product keeps no copy. Speeds are never measured here: a fake clock advances by fixed costs per product."""
import pytest
import torch

from hf_paged import trials
from hf_paged.model import SmallBatchLinears, greedy_head, packed_linear
from hf_paged.model.linear_choice import TABLE
from hf_paged.sampling import first_argmax
from hf_paged.trials import SAMPLES


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(trials, "clock", fake)
    for name in (packed_linear.SWITCH, greedy_head.SWITCH):
        monkeypatch.delenv(name, raising=False)
    TABLE.clear()
    yield fake
    TABLE.clear()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(64, 48)

    def forward(self, x):
        return self.proj(x)


@pytest.mark.skipif(not packed_linear._onednn_bf16(), reason="no oneDNN bf16 in this torch build")
@pytest.mark.parametrize("packed_wins", [True, False])
def test_a_packed_trial_keeps_the_faster_and_no_copy_for_f_linear(clock, monkeypatch, packed_wins):
    net = Net().to(torch.bfloat16)
    linears = SmallBatchLinears(net)
    real_packed, real_linear = packed_linear._packed_product, torch.nn.functional.linear
    costs = {"packed": 1e-3 if packed_wins else 3e-3, "f_linear": 2e-3}
    calls = dict.fromkeys(costs, 0)

    def packed(*args):
        calls["packed"] += 1
        clock.now += costs["packed"]
        return real_packed(*args)

    def linear(*args):
        calls["f_linear"] += 1
        clock.now += costs["f_linear"]
        return real_linear(*args)
    monkeypatch.setattr(packed_linear, "_packed_product", packed)
    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    want = real_linear(x, net.proj.weight, net.proj.bias)
    screen_copy = packed_linear.copy_for(net.proj, net.proj.weight, torch.int8)  # as a bf16 LM head's int8 screen
    for _ in range(2 * (1 + SAMPLES)):
        with linears.active(), torch.inference_mode():
            torch.testing.assert_close(net(x).float(), want.float(), rtol=2e-2, atol=2e-2)
    assert calls == dict.fromkeys(costs, 1 + SAMPLES) and not TABLE.trials  # in turn, each call timed
    (entry,) = TABLE.report()
    assert entry["path"] == ("packed" if packed_wins else "f_linear") and entry["source"] == "measured"
    assert entry["us"] == {name: cost * 1e6 for name, cost in costs.items()}
    assert (packed_linear._COPIES.get(net.proj) is not None) == packed_wins
    assert packed_linear._INT8.get(net.proj) is screen_copy  # not the packed trial's to drop


@pytest.mark.skipif(not greedy_head.bf16_available(), reason="no oneDNN bf16 or no C compiler")
@pytest.mark.parametrize("winner", [greedy_head.SCREEN, greedy_head.SCREEN8, greedy_head.PLAIN])
def test_a_greedy_head_trial_gives_picks_or_logits_and_keeps_only_the_winners_copy(clock, monkeypatch, winner):
    gen = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(64, 3000, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(3000, 64, generator=gen))
    x = torch.randn(1, 5, 64, generator=gen)
    want = first_argmax(torch.nn.functional.linear(x[0], head.weight))
    costs = {greedy_head.SCREEN: 3e-3, greedy_head.SCREEN8: 3e-3, greedy_head.PLAIN: 2.5e-3, winner: 2e-3}
    real_pick = greedy_head.pick

    def pick(module, rows, kind):
        clock.now += costs[kind]
        return real_pick(module, rows, kind)

    def plain(module, inputs):
        clock.now += costs[greedy_head.PLAIN]
        return torch.nn.functional.linear(inputs, module.weight)
    monkeypatch.setattr(greedy_head, "pick", pick)
    net = torch.nn.Module()
    net.head = head
    net.get_output_embeddings = lambda: head
    linears = SmallBatchLinears(net)
    assert linears.greedy_head is head
    seen = []
    for _ in range(3 * (1 + SAMPLES)):
        step = greedy_head.GreedyStep(head, plain)
        with linears.active(greedy=step), torch.inference_mode():
            out = head(x)
        if step.token_ids is not None:  # a screen's picks...
            seen.append("screen")
            assert torch.equal(step.token_ids, want)
        else:  # ...or the real logits, as the runner would sample them
            seen.append("logits")
            assert out is step.output and torch.equal(first_argmax(out[0]), want)
    assert sorted(seen) == ["logits"] * (1 + SAMPLES) + ["screen"] * 2 * (1 + SAMPLES) and not TABLE.trials
    (entry,) = TABLE.report()
    assert entry["dtype"] == "greedy" and entry["path"] == winner
    assert entry["us"] == {name: cost * 1e6 for name, cost in costs.items()}
    assert (packed_linear._COPIES.get(head) is not None) == (winner == greedy_head.SCREEN)
    assert (packed_linear._INT8.get(head) is not None) == (winner == greedy_head.SCREEN8)
    assert greedy_head.known_plain(head, 5) == (winner == greedy_head.PLAIN)
