"""The throughput benchmark's figure: output tokens/s against the number of requests, one line per system."""
from __future__ import annotations

from pathlib import Path

from .common import pyplot, save_figure


def plot(path: Path, report: dict) -> None:
    """Output tok/s against the number of requests, one line per system."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, system in enumerate(report["systems"]):
        points = sorted((r["requests"], r["tok_per_s"]) for r in report["results"]
                        if r["system"] == system and "tok_per_s" in r)
        if points:
            ax.plot(*zip(*points), marker="o", color=f"C{i}", label=system)
    ax.set_xscale("log", base=2)
    ax.set_xticks(report["requests"], [str(n) for n in report["requests"]])
    ax.set_xlabel("requests in one generate call")
    ax.set_ylabel("output tokens / s")
    model, arch = report["model"], report.get("arch", "llama")
    name = "Llama" if arch == "llama" else arch
    ax.set_title(f"random {name} (hidden {model['hidden']}, {model['layers']} layers), {report['max_tokens']} new "
                 f"tokens/request, {report['threads']} thread{'s' * (report['threads'] != 1)}", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    save_figure(fig, path)
