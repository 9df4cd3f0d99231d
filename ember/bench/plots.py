"""PNG plots of serving benchmarks (matplotlib, no display needed).

- `plot_latency_distribution`: one `ember bench serve` run: the CDFs of TTFT and TPOT.
- `plot_tune`: an `ember tune` report: output throughput, TTFT and TPOT (p99 solid, p50
  dashed) against the request rate, one colour per setting, the SLOs as horizontal lines,
  each setting's knee circled and the chosen one starred.

Each returns its Figure (for tests that read the plotted data back), already saved.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np


def require_matplotlib() -> None:
    """Called before a run whose results are to be plotted, so that a missing matplotlib
    is found before the run, not after it."""
    if importlib.util.find_spec("matplotlib") is None:
        raise RuntimeError("the plots need matplotlib: pip install matplotlib (or ember's bench extra)")


def _figure(ncols: int, width: float, height: float):
    from matplotlib.figure import Figure  # the object API: no pyplot state, no GUI backend

    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.subplots(1, ncols)


def _save(fig, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def plot_latency_distribution(ttft_ms: list[float], tpot_ms: list[float], path: str | Path, title: str = ""):
    """The CDFs of one run's TTFT and TPOT (ms), their p50 and p99 marked."""
    fig, axes = _figure(2, 10, 4)
    for ax, values, name in zip(axes, (ttft_ms, tpot_ms), ("TTFT", "TPOT")):
        v = np.sort(np.asarray(values, dtype=float))
        ax.step(v, np.arange(1, len(v) + 1) / max(len(v), 1), where="post", label=name)
        for q, style in ((50, ":"), (99, "--")):
            if len(v):
                ax.axvline(float(np.percentile(v, q)), color="grey", linestyle=style, label=f"p{q}")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.suptitle(f"Latency distribution: {title} ({len(ttft_ms)} requests)")
    _save(fig, path)
    return fig


def plot_tune(report: dict[str, Any], path: str | Path):
    """Throughput, TTFT and TPOT against the request rate, one line per setting of `report`
    (ember.bench.tune's JSON). Line labels: the setting's label, plus " p50" for the dashed
    median lines."""
    fig, (thr, ttft, tpot) = _figure(3, 17, 5)
    unit = "conversations/s" if report["workload"] == "shared-prefix" else "req/s"
    colours = [f"C{i % 10}" for i in range(len(report["settings"]))]
    best = report.get("best")
    for colour, setting in zip(colours, report["settings"]):
        points = setting["points"]
        if not points:
            continue
        rates = [p["rate"] for p in points]
        thr.plot(rates, [p["output_throughput"] for p in points], "o-", color=colour, label=setting["label"])
        for ax, key in ((ttft, "ttft"), (tpot, "tpot")):
            ax.plot(rates, [p[f"{key}_p99_ms"] for p in points], "o-", color=colour, label=setting["label"])
            ax.plot(rates, [p[f"{key}_p50_ms"] for p in points], "x--", color=colour, alpha=0.6,
                    label=setting["label"] + " p50")
        knee = setting.get("knee")
        if knee is not None:
            for ax, y in ((thr, knee["output_throughput"]), (ttft, knee["ttft_p99_ms"]), (tpot, knee["tpot_p99_ms"])):
                ax.scatter([knee["rate"]], [y], s=140, facecolors="none", edgecolors=colour, zorder=3)
    if best is not None:
        knee = best["knee"]
        for ax, y in ((thr, knee["output_throughput"]), (ttft, knee["ttft_p99_ms"]), (tpot, knee["tpot_p99_ms"])):
            ax.scatter([knee["rate"]], [y], marker="*", s=320, color="gold", edgecolors="black", zorder=4,
                       label=f"chosen: {best['label']} @ {knee['rate']:g} {unit}")
    slo = report["slo"]
    ttft.axhline(slo["ttft_p99_ms"], color="red", linestyle=":", label=f"SLO p99 {slo['ttft_p99_ms']:g} ms")
    tpot.axhline(slo["tpot_p99_ms"], color="red", linestyle=":", label=f"SLO p99 {slo['tpot_p99_ms']:g} ms")
    for ax, title, y_unit in ((thr, "Output throughput", "tok/s"), (ttft, "TTFT p99 (p50 dashed)", "ms"),
                              (tpot, "TPOT p99 (p50 dashed)", "ms")):
        ax.set_title(title)
        ax.set_xlabel(f"rate ({unit})")
        ax.set_ylabel(y_unit)
        ax.grid(alpha=0.3)
    handles, labels = thr.get_legend_handles_labels()
    thr.legend(handles, labels, fontsize="small")
    ttft.legend(*_without_p50(ttft), fontsize="small")
    tpot.legend(*_without_p50(tpot), fontsize="small")
    fig.suptitle(f"ember tune: {Path(report['model']).name} on {report['device']}, workload {report['workload']}")
    _save(fig, path)
    return fig


def _without_p50(ax) -> tuple[list, list]:
    pairs = [(h, label) for h, label in zip(*ax.get_legend_handles_labels()) if not label.endswith(" p50")]
    return [h for h, _ in pairs], [label for _, label in pairs]
