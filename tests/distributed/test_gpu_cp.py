"""Native decode under context parallel on two GPUs over NCCL (skipped without them): the CUDA-graph decode with
the cross-rank page merge gives one GPU's greedy tokens and log-probs (fp32). Runs scripts/bench/cp_decode_nccl.py
under torchrun and prints its row (decode ms per step on one GPU and under CP, bf16)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.distributed,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "cp_decode_nccl.py"


def test_cp2_decode_equals_one_gpu():
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(SCRIPT), "--prompt", "65536"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(row))
    assert row["fp32_tokens_equal"] and row["fp32_logprob_max_abs_err"] < 1e-4
