"""model/signatures.py: a forward's parameter names, read once per function."""
import inspect

import torch

from hf_paged.model import signatures
from hf_paged.model.signatures import parameter_names


class Block(torch.nn.Module):
    def forward(self, hidden_states, position_ids=None, **kwargs):
        return hidden_states


class Callable:
    def __call__(self, x, y=1):
        return x


def test_the_names_are_inspects():
    block = Block()
    for forward in (block.forward, Block.forward, Callable(), lambda a, *b, c=2, **d: a):
        assert parameter_names(forward) >= set(inspect.signature(forward).parameters)
    assert "position_ids" in parameter_names(block.forward) and "logits_to_keep" not in parameter_names(block.forward)


def test_a_function_is_read_once(monkeypatch):
    """Bound methods of one function share the reading; a function defined later (a patched forward) gets its own."""
    signatures._of_function.cache_clear()
    reads = []
    original = inspect.signature

    def counting(obj, *args, **kwargs):
        reads.append(obj)
        return original(obj, *args, **kwargs)

    monkeypatch.setattr(inspect, "signature", counting)
    first, second = Block(), Block()
    for _ in range(3):
        parameter_names(first.forward), parameter_names(second.forward)
    assert len(reads) == 1

    def patched(self, input_ids, attention_mask=None):
        return input_ids

    first.forward = patched.__get__(first)
    assert parameter_names(first.forward) == {"self", "input_ids", "attention_mask"} and len(reads) == 2
