"""What is alive at the peak of one replay (CUDA): the allocations made during a response's forward + backward
that are live at its allocator peak, largest first, each with the frames that allocated it.

The analytic bound counts weights, grads, optimizer state, the resident state and the response's saved graph;
everything this script lists beyond the saved graph is a transient of the backward. Run after a first replay, so
.grad already exists, as in replays 2..G of a transaction.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

from longstraw_cli.models import MODEL_NAMES, build_model  # noqa: E402

GIB = 2**30


def replay(model, resident, response, chunk):
    logp = model.logprobs(resident, response, grad=True, chunk_size=chunk)
    logp.sum().backward()


def live_at_peak(events, start_bytes):
    """Replay the allocator trace: (peak bytes, {addr: (size, frames)} live at the peak among traced blocks)."""
    live, current, peak, at_peak = {}, start_bytes, start_bytes, {}
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames", []))
            current += e["size"]
            if current > peak:
                peak, at_peak = current, dict(live)
        elif e["action"] == "free_completed" and e["addr"] in live:
            current -= live.pop(e["addr"])[0]
    return peak, at_peak


def where(frames) -> str:
    ours = [f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in frames
            if "longstraw" in f["filename"]]
    torch_fn = [f["name"] for f in frames if "torch" in f["filename"]][:2]
    return " <- ".join(ours[:3]) or " <- ".join(torch_fn) or "?"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen36_mini", choices=MODEL_NAMES)
    p.add_argument("--prompt", type=int, default=16384)
    p.add_argument("--response", type=int, default=1024)
    p.add_argument("--logprob-chunk", type=int, default=512)
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args(argv)
    model = build_model(args.model, dtype=torch.bfloat16, device="cuda", seed=0)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (args.prompt,), generator=g).cuda()
    response = torch.randint(0, model.config.vocab_size, (args.response,), generator=g).cuda()
    resident = model.capture(prompt, block_size=8192)
    replay(model, resident, response, args.logprob_chunk)  # .grad exists from here on
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    replay(model, resident, response, args.logprob_chunk)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = snapshot["device_traces"][torch.cuda.current_device()]
    peak, at_peak = live_at_peak(events, start)
    print(f"before the replay {start / GIB:.2f} GiB (weights + grads + resident); allocator peak "
          f"{torch.cuda.max_memory_allocated() / GIB:.2f} GiB; traced peak {peak / GIB:.2f} GiB, "
          f"{(peak - start) / GIB:.2f} GiB above the start in {len(at_peak)} blocks")
    by_site: dict[str, list[int]] = {}
    for size, frames in at_peak.values():
        by_site.setdefault(where(frames), []).append(size)
    for site, sizes in sorted(by_site.items(), key=lambda kv: -sum(kv[1]))[: args.top]:
        print(f"{sum(sizes) / GIB:8.3f} GiB in {len(sizes):4d} blocks  {site}")


if __name__ == "__main__":
    sys.exit(main())
