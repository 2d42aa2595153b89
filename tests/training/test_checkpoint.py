"""Checkpoint round trip (model, AdamW state, every RNG), atomicity (temp and unmarked directories are never
loaded), retention, rank gating and the errors a corrupt checkpoint gives."""

import random

import pytest
import torch

from longstraw_cli.checkpoint import COMPLETE_FILE, CheckpointError, CheckpointManager, format_whole
from longstraw_cli.checkpoint.format_whole import MODEL_FILE, OPTIMIZER_FILE
from longstraw_cli.checkpoint.trainer_state import capture_rng, restore_rng


class Tiny(torch.nn.Module):
    """Tied embedding/head, like qwen36 with tie_word_embeddings: safetensors refuses shared storages unless cloned."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.mid = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.embed(ids))))


def train_step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 11, (5,), generator=g)
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(ids), ids).backward()
    opt.step()


def make(seed=0):
    torch.manual_seed(seed)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt


def save_one(mgr, step, model=None, opt=None):
    model, opt = (model, opt) if model is not None else make()
    return format_whole.save(mgr, step, model_state=model.state_dict(), optimizer_state=opt.state_dict(),
                    trainer_state={"data_position": step * 10})


def draws(sampler):
    return (torch.rand(4), random.random(), torch.rand(3, generator=sampler), torch.randint(0, 1000, (3,)))


def test_round_trip_model_optimizer_and_rng(tmp_path):
    model, opt = make()
    for s in range(3):
        train_step(model, opt, s)
    sampler = torch.Generator().manual_seed(123)
    torch.rand(7, generator=sampler)  # move it off its seed
    mgr = CheckpointManager(tmp_path)
    path = format_whole.save(mgr, 3, model_state=model.state_dict(), optimizer_state=opt.state_dict(),
                    trainer_state={"data_position": 42, "rng": capture_rng({"sampler": sampler})})
    expected = draws(sampler)
    train_step(model, opt, 3)
    expected_params = {n: p.detach().clone() for n, p in model.named_parameters()}

    assert mgr.latest() == path and path.name == "step_00000003"
    model_state, opt_state, trainer_state = format_whole.load(path)
    assert trainer_state["step"] == 3 and trainer_state["data_position"] == 42
    fresh, fresh_opt = make(seed=99)
    fresh.load_state_dict(model_state)
    fresh_opt.load_state_dict(opt_state)
    assert fresh.head.weight is fresh.embed.weight
    # the state dicts equal what was saved, tensors and step counts alike
    saved_opt = torch.load(path / OPTIMIZER_FILE, weights_only=True)
    for pid, st in saved_opt["state"].items():
        for k, v in st.items():
            assert torch.equal(fresh_opt.state_dict()["state"][pid][k], v)
    assert fresh_opt.state_dict()["param_groups"] == saved_opt["param_groups"]

    other = torch.Generator().manual_seed(0)
    random.seed(7), torch.manual_seed(7)
    restore_rng(trainer_state["rng"], {"sampler": other})
    got = draws(other)
    for a, b in zip(got, expected):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    # the next optimizer step from the restored state is the uninterrupted run's step, bit for bit
    train_step(fresh, fresh_opt, 3)
    for n, p in fresh.named_parameters():
        assert torch.equal(p, expected_params[n]), n


def test_numpy_rng_round_trip():
    np = pytest.importorskip("numpy")
    np.random.seed(3)
    np.random.normal()  # leaves a cached gaussian, part of the state
    state = capture_rng({})
    expected = (np.random.rand(5), np.random.normal())
    np.random.seed(0)
    restore_rng(state, {})
    got = (np.random.rand(5), np.random.normal())
    assert (got[0] == expected[0]).all() and got[1] == expected[1]


def test_restore_rng_rejects_other_generator_names():
    state = capture_rng({"sampler": torch.Generator()})
    with pytest.raises(ValueError, match=r"missing \['sampler'\], unknown \['data'\]"):
        restore_rng(state, {"data": torch.Generator()})


def test_half_written_checkpoints_are_ignored_and_temp_dirs_cleaned(tmp_path):
    mgr = CheckpointManager(tmp_path)
    good = save_one(mgr, 5)
    ckpt = tmp_path / "checkpoints"
    # a kill during save leaves a temp dir; a directory without the marker must not count either
    tmp = ckpt / "step_00000007.tmp-4242"
    tmp.mkdir()
    (tmp / MODEL_FILE).write_bytes(b"partial")
    unmarked = ckpt / "step_00000009"
    unmarked.mkdir()
    (unmarked / MODEL_FILE).write_bytes(b"partial")

    assert mgr.latest() == good
    with pytest.raises(CheckpointError, match="COMPLETE"):
        format_whole.load(unmarked)
    assert CheckpointManager(tmp_path).latest() == good
    assert not tmp.exists(), "stale temp dirs are removed when a manager starts"
    assert unmarked.exists(), "only .tmp- directories are deleted"


def test_keep_two(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=2)
    model, opt = make()
    for step in (10, 20, 30, 40):
        save_one(mgr, step, model, opt)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_00000030", "step_00000040"]
    assert mgr.latest().name == "step_00000040"
    # re-saving an existing step replaces it
    save_one(mgr, 40, model, opt)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == names
    with pytest.raises(ValueError, match="keep"):
        CheckpointManager(tmp_path, keep=0)


def test_nonzero_rank_writes_nothing(tmp_path):
    mgr = CheckpointManager(tmp_path / "run", rank=1)
    assert save_one(mgr, 1) is None
    assert not (tmp_path / "run").exists()
    assert mgr.latest() is None
    # other ranks still read what rank 0 wrote
    written = save_one(CheckpointManager(tmp_path / "run"), 2)
    assert mgr.latest() == written


@pytest.mark.parametrize("name", [MODEL_FILE, OPTIMIZER_FILE])
def test_corrupt_file_error_names_the_file(tmp_path, name):
    mgr = CheckpointManager(tmp_path)
    path = save_one(mgr, 1)
    f = path / name
    data = f.read_bytes()
    # truncated: caught by the sizes recorded in COMPLETE
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=name):
        format_whole.load(path)
    # same size, garbage bytes: caught by the loader
    f.write_bytes(b"\xff" * len(data))
    with pytest.raises(CheckpointError, match=name):
        format_whole.load(path)


def test_views_and_noncontiguous_tensors_save(tmp_path):
    base = torch.arange(24.0).reshape(4, 6)
    state = {"a": base, "rows": base[1:3], "t": base.t(), "b": torch.ones(3)}
    mgr = CheckpointManager(tmp_path)
    path = format_whole.save(mgr, 0, model_state=state, optimizer_state={}, trainer_state={})
    loaded, _, _ = format_whole.load(path)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert (path / COMPLETE_FILE).is_file()
