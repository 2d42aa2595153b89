"""Record fla's autotuning choices on this GPU: run `longstraw train` in this process, then write what its kernels'
autotuners chose (longstraw_kernels/autotuned.py) into a file of the GPU's name, or merge them into one.

The run should exercise every kernel a user's run calls, at each shape that keys the autotuning (the model's head
counts and dims, not the prompt's length): e.g. one qwen36_mini run with capture.gradient=exact (capture, scoring,
replay, decode and the exact walk) and one at another model shape. Run it with empty Triton caches
(compile_cache_dir=<new dir>), or the autotuners read their choices from the disk cache: those are recorded too.

    python scripts/bench/record_autotune.py --out longstraw_kernels/autotuned/NVIDIA_H200.json -- model=qwen36_mini \\
        model.dtype=bfloat16 device=cuda prompt_tokens=16384 response_tokens=64 steps=1 checkpoint.enabled=false
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from longstraw_cli.cli import train
from longstraw_kernels.autotuned import merged, record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the file to write (merged into when it exists)")
    parser.add_argument("--prefix", default="fla.", help="record the autotuners of modules under this prefix")
    parser.add_argument("overrides", nargs="*", help="longstraw train overrides (after --)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("record_autotune needs a CUDA device: the choices are the GPU's")
    code = train(args.overrides)
    if code:
        raise SystemExit(code)
    data = record(args.prefix, torch.cuda.get_device_name(), torch.cuda.get_device_capability())
    out = Path(args.out)
    if out.exists():
        try:
            data = merged(json.loads(out.read_text()), data)
        except ValueError as e:
            raise SystemExit(f"{out}: {e}") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"{len(data['entries'])} choices of {len({(e['module'], e['name']) for e in data['entries']})} kernels "
          f"-> {out} ({data['gpu']}, {data['versions']})")


if __name__ == "__main__":
    main()
