"""One JSON row per measurement: printed (the device call's output carries the end of it) and appended to --out."""

from __future__ import annotations

import json


def emit(row: dict, out: str | None) -> None:
    print(json.dumps(row), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
