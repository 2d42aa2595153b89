"""Plots of bench_step.py results: peak memory against prompt length (both methods) and against G.

    python scripts/bench/plot.py docs/bench/h200-2026-11-29.jsonl [more.jsonl ...] docs/bench

Rows of later files (and later lines) supersede earlier rows of the same configuration. Peak memory against the
prompt plots every measured G (LongStraw's peak does not depend on G; the baseline's is one replay's).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    *results, out_dir = (Path(a) for a in argv)
    rows = [json.loads(line) for path in results for line in path.read_text().splitlines() if line.strip()]
    # a later run of the same configuration supersedes an earlier one
    latest = {(r["model"], r.get("lora_rank", 0), r["method"], r["prompt_tokens"], r["group_size"]): r for r in rows}
    mini = [r for r in latest.values() if r["model"] == "qwen36_mini" and r.get("lora_rank", 0) == 0]
    gib = 2**30

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, marker in (("longstraw", "o"), ("naive", "s")):
        peaks = {}
        for r in mini:
            if r["method"] == method and r["status"] == "ok":
                peaks[r["prompt_tokens"]] = max(peaks.get(r["prompt_tokens"], 0), r["peak_bytes"] / gib)
        if peaks:
            ax.plot(*zip(*sorted(peaks.items())), marker=marker, label=method)
    ax.axhline(139.8, color="grey", ls="--", lw=1, label="H200 capacity")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("peak GPU memory (GiB)")
    ax.set_title("qwen36_mini, bf16, 1K-token responses, one H200")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "peak_vs_prompt.png", dpi=120)

    fig, ax = plt.subplots(figsize=(6, 4))
    for prompt in sorted({r["prompt_tokens"] for r in mini if r["method"] == "longstraw"}):
        ok = sorted((r["group_size"], r["peak_bytes"] / gib) for r in mini
                    if r["method"] == "longstraw" and r["status"] == "ok" and r["prompt_tokens"] == prompt)
        ax.plot(*zip(*ok), marker="o", label=f"P={prompt // 1024}K")
    ax.set_xlabel("group size G")
    ax.set_ylabel("peak GPU memory (GiB)")
    ax.set_title("LongStraw peak memory against G (qwen36_mini)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "peak_vs_group.png", dpi=120)


if __name__ == "__main__":
    main(sys.argv[1:])
