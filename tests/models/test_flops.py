"""The analytic capture FLOP count (longstraw_cli/plan/flops.py) against torch's FlopCounterMode on CPU.

On CPU the capture runs the torch references (no Triton), whose matrix products FlopCounterMode counts: mm, bmm
(einsum lowers to them) and the depthwise convolution. Neither side counts elementwise work, and FlopCounterMode
does not count torch.linalg.solve_triangular (the chunked delta rule's solve), which the analytic count leaves out
too. The references do more products than the model needs, and the count is told how many:
- attention (qwen36) and index scores (glm52): each capture block scores its queries against every key up to the
  block's end, a rectangle, and masks the block's future keys afterwards: sum over blocks of T_b x end_b pairs
  instead of the causal ones;
- glm52's sparse attention: the torch reference computes all index_topk slots of every query (-1 slots masked),
  index_topk pairs a query instead of min(index_topk, t + 1);
- the chunked delta rule pads each block to whole chunks of 64 tokens.
With those counts substituted the analytic count must equal FlopCounterMode's exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from longstraw_cli.models import build_model
from longstraw_cli.models.core import capture_blocks
from longstraw_cli.models.glm52.config import named_config
from longstraw_cli.plan.flops import GDN_CHUNK, capture_flops, causal_pairs, selected_pairs


def counted(model, num_tokens: int, block_size: int) -> int:
    ids = torch.randint(0, model.config.vocab_size, (num_tokens + 1,), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model.capture(ids, block_size=block_size)
    return counter.get_total_flops()


def rectangle_pairs(num_tokens: int, block_size: int) -> int:
    return sum((end - start) * end for start, end in capture_blocks(num_tokens, block_size))


@pytest.mark.parametrize("num_tokens,block_size,dtype", [(62, 16, torch.float32), (200, 37, torch.float64)])
def test_qwen36_count_equals_flop_counter(num_tokens, block_size, dtype):
    model = build_model("qwen36_tiny", dtype=dtype, seed=0)
    padded = sum(-(-(end - start) // GDN_CHUNK) * GDN_CHUNK for start, end in capture_blocks(num_tokens, block_size))
    analytic = capture_flops(model, num_tokens, attention_pairs=rectangle_pairs(num_tokens, block_size),
                             gdn_tokens=padded)
    assert analytic["total"] == counted(model, num_tokens, block_size)


@pytest.mark.parametrize("num_tokens,block_size,dtype", [(62, 16, torch.float32), (200, 37, torch.float64)])
def test_glm52_count_equals_flop_counter(num_tokens, block_size, dtype):
    model = build_model("glm52_tiny", dtype=dtype, seed=0)
    analytic = capture_flops(model, num_tokens, index_pairs=rectangle_pairs(num_tokens, block_size),
                             attended_pairs=num_tokens * model.config.index_topk)
    assert analytic["total"] == counted(model, num_tokens, block_size)


def test_causal_counts_and_named_configs():
    # the model's own work: causal pairs, the ramp of DSA selections, by name or config alike
    assert causal_pairs(4) == 10 and selected_pairs(5, 3) == 1 + 2 + 3 + 3 + 3 and selected_pairs(2, 8) == 3
    glm = capture_flops("glm52_tiny", 200)
    assert glm["index_scores"] == 2 * 2 * 4 * 16 * causal_pairs(200)  # two full layers, J=4, I=16
    assert glm["attention"] == 4 * 2 * 4 * (2 * 32 + 8) * selected_pairs(200, 16)
    # the qwen36 count's linear and attention terms are bench_capture's earlier ones (the 63% at 256K)
    qwen = capture_flops("qwen36_mini", 262144)
    assert qwen["linear"] == 719699079856128
    assert qwen["attention"] == pytest.approx(3377699720527872.0, rel=1e-5)
    assert sum(v for k, v in qwen.items() if k != "total") == qwen["total"]


def test_bench_train_capture_rate(monkeypatch):
    # bench_train's rows: the recorded GLM-5 shape at 9 layers, 256K, steady capture 37.42 s on one H200
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "scripts" / "bench"))
    from bench_train import capture_rate

    command = ("-m longstraw_cli train model=glm52 model.dtype=bfloat16 lora.rank=16 "
               "model.override_config={num_hidden_layers:9} prompt_tokens=262144 steps=2")
    rate = capture_rate(command, 262144, 37.42)
    expected = capture_flops(named_config("glm52", num_hidden_layers=9), 262143)
    assert rate["capture_flops"] == expected
    assert rate["capture_tflops"] == pytest.approx(expected["total"] / 37.42e12)
    assert rate["capture_utilisation"] == pytest.approx(rate["capture_tflops"] / 798.3)
    assert capture_rate(command, 262144, 37.42, ranks=2)["capture_utilisation"] == pytest.approx(
        rate["capture_utilisation"] / 2)
    assert capture_rate("-m longstraw_cli train model.path=/ckpt", 262144, 1.0) == {}


def test_bench_capture_alternates_its_kernel_choices(monkeypatch):
    """bench_capture --kernels: the default choices and the changed ones in the order A B B A A B, each run under
    its own choice, the one in force put back; a bad choice is a usage error before anything is built."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "scripts" / "bench"))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")  # the script sets a default for CUDA runs on import
    import bench_capture

    from longstraw_kernels import kernel_choice

    seen = []
    monkeypatch.setattr(bench_capture, "timed", lambda run: seen.append(kernel_choice("norm")) or float(len(seen)))
    times = bench_capture.alternated(None, "norm=torch", 3)
    assert times == {"default": [1.0, 4.0, 5.0], "norm=torch": [2.0, 3.0, 6.0]}
    assert seen == ["auto", "torch", "torch", "auto", "auto", "torch"] and kernel_choice("norm") == "auto"
    for bad in ("norm=fast", "norm", "fast=torch"):
        with pytest.raises(SystemExit, match="2"):
            bench_capture.main(["--kernels", bad])
    assert kernel_choice("norm") == "auto"
    assert bench_capture.alternated(None, "kernels.norm=torch", 1) == {"default": [7.0], "kernels.norm=torch": [8.0]}
    assert seen[-2:] == ["auto", "torch"]


def test_bench_capture_counts_synchronisations_by_the_line_of_ours_that_made_them(monkeypatch):
    """bench_capture --syncs: each warning the sync debug mode raises is counted at the innermost frame of
    longstraw's packages (else where it was raised), other warnings are shown and not counted, the mode is on only
    around the run and off after it, even when the run fails, and warnings outside the count are left as they
    were."""
    import warnings

    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "scripts" / "bench"))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    import bench_capture

    modes = []
    monkeypatch.setattr(bench_capture.torch.cuda, "set_sync_debug_mode", modes.append)
    # a function of "ours": compiled under a path inside longstraw_cli, called through one that is not
    ours = {}
    exec(compile("import warnings\ndef sync():\n    warnings.warn('called a synchronizing CUDA operation')\n",
                 str(Path("/x") / "longstraw_cli" / "models" / "fake.py"), "exec"), ours)

    def run():
        for _ in range(3):
            ours["sync"]()
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)  # here: no frame of ours below
        warnings.warn("some other warning", stacklevel=1)  # shown, not counted

    shown = warnings.showwarning
    with pytest.warns(UserWarning, match="some other warning") as other:
        counted = bench_capture.counted_syncs(run)
    assert len(other) == 1, [str(w.message) for w in other]
    assert counted["total"] == 4 and counted["sites"]["fake.py:3"] == 3, counted
    assert [n for site, n in counted["sites"].items() if site.startswith("test_flops.py:")] == [1], counted
    assert modes == ["warn", 0] and warnings.showwarning is shown

    def fails():
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        bench_capture.counted_syncs(fails)
    assert modes[-2:] == ["warn", 0] and warnings.showwarning is shown
