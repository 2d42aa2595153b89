"""qwen36's own checks: resident bytes by formula, and the groups a transaction rejects. The model contract that
every family meets (capture and replay against the full-sequence reference, gradients, immutability, memory) is
in test_model_contract.py."""

import pytest
import torch

from conftest import ids, randomize_
from longstraw_cli.distributed.strategy import LocalStrategy
from longstraw_cli.models import build_model
from longstraw_cli.rl.losses import LossConfig
from longstraw_cli.telemetry.memory import PhaseClock
from longstraw_cli.transaction import Transaction


def tiny(dtype=torch.float64, seed=0):
    model = build_model("qwen36_tiny", dtype=dtype)
    randomize_(model, seed)
    return model


@pytest.mark.parametrize("page_dtype", [None, torch.bfloat16])
def test_resident_bytes_match_analytic_formula(page_dtype):
    model = tiny(torch.float32)
    prompt = torch.randint(0, 259, (130,))
    resident = model.capture(prompt, block_size=50, page_dtype=page_dtype)
    assert resident.nbytes() == model.resident_bytes(129, page_dtype)
    cfg = model.config
    # 2 attention layers x (K + V) x 129 tokens x 2 kv heads x 32 dims; 6 GDN layers x [4, 16, 16] fp32
    page_size = 2 if page_dtype is torch.bfloat16 else 4
    assert resident.nbytes()["kv_pages"] == 2 * 2 * 129 * cfg.num_key_value_heads * cfg.head_dim * page_size
    assert resident.nbytes()["recurrent_state"] == 6 * 4 * 16 * 16 * 4


def test_transaction_rejects_bad_groups():
    model = tiny(torch.float32)
    strategy = LocalStrategy(model, torch.optim.SGD(model.parameters(), lr=0.0), max_grad_norm=1.0)
    tx = Transaction(model, strategy, LossConfig())
    prompt = ids(60, 0)
    with pytest.raises(ValueError, match=">= 2 responses"):
        tx.run(prompt, [ids(12, 1)], torch.rand(1), tx.capture(prompt))
    with pytest.raises(ValueError, match="kl_coef"):
        Transaction(model, strategy, LossConfig(kl_coef=0.1))


def test_transaction_times_its_phases_on_the_callers_clock():
    """One clock per iteration: the caller's phases (here the capture) and the transaction's land on it, in order;
    a repeated phase accumulates. On CPU the clock records time only (no allocator peak)."""
    model = tiny(torch.float32)
    prompt, responses, rewards = ids(60, 0), [ids(12, 1), ids(12, 2)], torch.rand(2)
    tx = Transaction(model, LocalStrategy(model, torch.optim.SGD(model.parameters(), lr=0.0), max_grad_norm=1.0),
                     LossConfig())
    clock = PhaseClock("cpu")
    with clock.phase("capture"):
        resident = tx.capture(prompt)
    result = tx.run(prompt, responses, rewards, resident, clock=clock)
    assert list(clock.time_metrics()) == ["time/capture", "time/score", "time/replay", "time/finalize", "time/step"]
    assert result.seconds is clock.seconds and all(s > 0 for s in clock.seconds.values())
    assert clock.memory_metrics() == {} and result.cuda_peak_bytes == {}
    replay = clock.seconds["replay"]
    with clock.phase("replay"):
        pass
    assert clock.seconds["replay"] >= replay and len(clock.seconds) == 5
