"""qwen36's own checks: resident bytes by formula, and the groups a transaction rejects. The model contract that
every family meets (capture and replay against the full-sequence reference, gradients, immutability, memory) is
in test_model_contract.py."""

import pytest
import torch

from conftest import ids, randomize_
from longstraw_cli.models import build_model
from longstraw_cli.rl.losses import LossConfig
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
    tx = Transaction(model, torch.optim.SGD(model.parameters(), lr=0.0), LossConfig())
    with pytest.raises(ValueError, match=">= 2 responses"):
        tx.run(ids(60, 0), [ids(12, 1)], torch.rand(1))
    with pytest.raises(ValueError, match="kl_coef"):
        Transaction(model, torch.optim.SGD(model.parameters(), lr=0.0), LossConfig(kl_coef=0.1))
