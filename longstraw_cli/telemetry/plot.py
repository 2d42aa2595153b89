"""Memory by phase over a run, drawn from metrics.jsonl: one line per `mem/*` key (bytes in the file, GiB on the
plot). The trainer writes run_dir/memory.png with it at the end of a run.

matplotlib is optional (`pip install longstraw[plot]`) and imported only here; the figure is drawn on an Agg
canvas directly, without pyplot, so no global backend is switched.
"""

from __future__ import annotations

import os
from pathlib import Path

from longstraw_cli.telemetry.metrics import read_metrics


def plot_memory(metrics_path: Path, out_png: Path) -> Path:
    """Writes the PNG (atomically) and returns its path; ValueError if the file has no `mem/*` values."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("plot_memory needs matplotlib: pip install longstraw[plot]") from e

    metrics_path, out_png = Path(metrics_path), Path(out_png)
    rows = read_metrics(metrics_path)
    # first-appearance order, so colours stay put from one run to the next
    keys = list(dict.fromkeys(k for row in rows for k in row if k.startswith("mem/")))
    if not keys:
        raise ValueError(f"{metrics_path}: no mem/* metrics to plot")

    fig = Figure(figsize=(8, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for key in keys:
        points = [(row["step"], row[key] / 2**30) for row in rows if key in row]
        steps, gib = zip(*points)
        ax.plot(steps, gib, marker="." if len(points) < 50 else None, label=key[4:])
    ax.set_xlabel("step")
    ax.set_ylabel("memory (GiB)")
    ax.set_title(f"Memory by phase: {metrics_path.parent.name or metrics_path.name}")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")

    out_png.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_png.with_name(f"{out_png.name}.tmp-{os.getpid()}")
    fig.savefig(tmp, format="png")
    os.replace(tmp, out_png)
    return out_png
