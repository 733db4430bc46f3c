"""bench/gpu_parity.py: it borrows tests/conftest.py's helpers by path; explaining a divergence works on the CPU."""
import torch

from hf_paged.bench import gpu_parity
from hf_paged.tiny import tiny_model


def test_the_suite_helpers_are_this_checkouts_conftest():
    helpers = gpu_parity.suite_helpers()
    ids, mask = helpers.left_padded_batch([3, 5])
    assert ids.shape == (2, 5) and mask.sum().item() == 8
    assert helpers.__name__ != "conftest"  # loaded beside pytest's own conftest, not over it


def test_explain_divergences_names_the_rows_that_part(one_torch_thread):
    model = tiny_model("llama")
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    with torch.no_grad():
        rows = [model.generate(torch.tensor([p]), max_new_tokens=4, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    assert gpu_parity.explain_divergences(model, prompts, rows, rows) == []
    other = [rows[0], rows[1][:2] + [(rows[1][2] + 1) % model.config.vocab_size, rows[1][3]]]
    found = gpu_parity.explain_divergences(model, prompts, rows, other)
    assert [entry[:2] for entry in found] == [(1, 2)]


def test_an_installed_package_without_the_tests_says_what_it_needs(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_parity, "TESTS", tmp_path)
    try:
        gpu_parity.suite_helpers()
    except RuntimeError as error:
        assert "tests/conftest.py" in str(error)
    else:
        raise AssertionError("no error without tests/conftest.py")
