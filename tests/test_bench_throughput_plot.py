"""bench/throughput_plot.py: the throughput figure draws one line per system through its measured points (sorted by
request count, failed runs left out), on a log2 axis ticked at the report's request counts, titled with the model,
the new tokens and the threads; without matplotlib it writes nothing."""
import pytest

from hf_paged.bench import throughput_plot

pytest.importorskip("matplotlib")


def report(**overrides):
    base = {"systems": ["hf_paged", "hf_padded", "hf_generate_batch"], "requests": [4, 16, 64], "max_tokens": 8,
            "threads": 1, "model": {"hidden": 128, "layers": 2},
            "results": [{"system": "hf_paged", "requests": 64, "tok_per_s": 300.0},
                        {"system": "hf_paged", "requests": 4, "tok_per_s": 40.0},
                        {"system": "hf_paged", "requests": 16, "tok_per_s": 120.0},
                        {"system": "hf_padded", "requests": 4, "tok_per_s": 30.0},
                        {"system": "hf_padded", "requests": 16, "error": "boom"},
                        {"system": "hf_generate_batch", "requests": 4, "error": "boom"}]}
    base.update(overrides)
    return base


@pytest.fixture
def figure(monkeypatch):
    """The figure plot() would save, and where."""
    saved = {}
    monkeypatch.setattr(throughput_plot, "save_figure", lambda fig, path: saved.update(fig=fig, path=path))
    yield saved
    if "fig" in saved:
        import matplotlib.pyplot as plt

        plt.close(saved["fig"])


def test_one_line_per_system_with_points(figure, tmp_path):
    throughput_plot.plot(tmp_path / "t.png", report())
    assert figure["path"] == tmp_path / "t.png"
    (ax,) = figure["fig"].axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"hf_paged", "hf_padded"}  # hf_generate_batch only failed: no line
    assert list(lines["hf_paged"].get_xdata()) == [4, 16, 64]  # sorted by request count
    assert list(lines["hf_paged"].get_ydata()) == [40.0, 120.0, 300.0]
    assert list(lines["hf_padded"].get_xdata()) == [4] and list(lines["hf_padded"].get_ydata()) == [30.0]
    assert lines["hf_paged"].get_color() != lines["hf_padded"].get_color()


def test_axes_and_title(figure, tmp_path):
    throughput_plot.plot(tmp_path / "t.png", report())
    (ax,) = figure["fig"].axes
    assert ax.get_xscale() == "log" and list(ax.get_xticks()) == [4, 16, 64]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["4", "16", "64"]
    assert ax.get_ylim()[0] == 0
    assert ax.get_title() == "random Llama (hidden 128, 2 layers), 8 new tokens/request, 1 thread"
    throughput_plot.plot(tmp_path / "t.png", report(threads=4, arch="qwen3_5_text"))
    assert figure["fig"].axes[0].get_title() == ("random qwen3_5_text (hidden 128, 2 layers), 8 new tokens/request, "
                                                 "4 threads")


def test_writes_a_png(tmp_path, capsys):
    throughput_plot.plot(tmp_path / "t.png", report())
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    assert f"plot written to {tmp_path / 't.png'}" in capsys.readouterr().out


def test_without_matplotlib_nothing_is_written(monkeypatch, tmp_path):
    monkeypatch.setattr(throughput_plot, "pyplot", lambda: None)
    throughput_plot.plot(tmp_path / "t.png", report())
    assert not (tmp_path / "t.png").exists()
