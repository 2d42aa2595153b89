"""Shipped autotuning choices (longstraw_kernels/autotuned.py): what `record` reads from an autotuner, `seed` gives
back to a fresh one, which then runs the recorded config without timing any (on the GPU where there is one, else in
Triton's interpreter on CPU: tests/conftest.py turns it on only without CUDA); stale versions, configs that are not
candidates and keys already chosen are left alone."""

import json

import pytest
import torch
import triton
import triton.language as tl

from longstraw_kernels import autotuned, use_kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIGS = [triton.Config({"BLOCK": 16}, num_warps=1), triton.Config({"BLOCK": 32}, num_warps=2)]


@triton.autotune(configs=CONFIGS, key=["N"])
@triton.jit
def _double_kernel(x_ptr, y_ptr, N, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < N
    tl.store(y_ptr + offsets, 2 * tl.load(x_ptr + offsets, mask=mask), mask=mask)


def _double(x):
    y = torch.empty_like(x)
    _double_kernel[lambda meta: (triton.cdiv(x.numel(), meta["BLOCK"]),)](x, y, x.numel())
    return y


@pytest.fixture
def fresh(monkeypatch):
    """The toy autotuner with an empty table, and timing any config made an error."""
    monkeypatch.setattr(_double_kernel, "cache", {})

    def no_timing(*args, **kwargs):
        raise AssertionError("the autotuner timed a config")

    monkeypatch.setattr(_double_kernel, "_bench", no_timing)
    return _double_kernel


def _chosen(key, config) -> dict:
    """A file as `record` writes it after the toy kernel chose `config` for `key`."""
    _double_kernel.cache[key] = config
    data = autotuned.record(__name__, "Toy GPU 1")
    _double_kernel.cache.clear()
    return data


def test_record_then_seed_runs_the_recorded_config_without_timing(fresh):
    x = torch.arange(40, dtype=torch.float32, device=DEVICE)
    key = (40, "torch.float32", "torch.float32")  # Triton's key: N, then each tensor argument's dtype
    data = _chosen(key, CONFIGS[1])
    assert data["gpu"] == "Toy_GPU_1" and data["versions"]["triton"] == triton.__version__
    entry, = data["entries"]
    assert entry == {"module": __name__, "name": "_double_kernel", "key": list(key),
                     "config": CONFIGS[1].all_kwargs()}
    data = json.loads(json.dumps(data))  # through the file's format
    assert autotuned.seed(data) == (1, None)
    assert fresh.cache[key] is CONFIGS[1]
    assert torch.equal(_double(x), 2 * x)
    assert fresh.best_config is CONFIGS[1]
    # another length is not in the file: the autotuner would time its configs
    with pytest.raises(AssertionError, match="timed a config"):
        _double(torch.arange(41, dtype=torch.float32, device=DEVICE))


def test_seed_leaves_stale_files_foreign_configs_and_chosen_keys_alone(fresh):
    key = (40, "torch.float32", "torch.float32")
    data = _chosen(key, CONFIGS[0])
    stale = {**data, "versions": {**data["versions"], "triton": "0.0.1"}}
    seeded, why = autotuned.seed(stale)
    assert seeded == 0 and "triton 0.0.1" in why and not fresh.cache
    foreign = json.loads(json.dumps(data))
    foreign["entries"][0]["config"]["BLOCK"] = 64  # not one of the kernel's candidates
    assert autotuned.seed(foreign) == (0, None) and not fresh.cache
    fresh.cache[key] = CONFIGS[1]
    assert autotuned.seed(data) == (0, None) and fresh.cache[key] is CONFIGS[1]


def test_seed_shipped_reads_the_gpu_file_once_and_can_be_turned_off(fresh, tmp_path, monkeypatch):
    key = (40, "torch.float32", "torch.float32")
    (tmp_path / "Toy_GPU_1.json").write_text(json.dumps(_chosen(key, CONFIGS[1])))
    monkeypatch.setattr(autotuned, "SHIPPED_DIR", tmp_path)
    monkeypatch.setattr(autotuned, "_SEEDED", set())
    with use_kernels(autotuned=False):
        assert autotuned.seed_shipped("Toy GPU 1", __name__) == 0 and not fresh.cache
    assert autotuned.seed_shipped("Other GPU", __name__) == 0  # no file for it
    monkeypatch.setattr(autotuned, "_SEEDED", set())
    assert autotuned.seed_shipped("Toy GPU 1", __name__) == 1 and fresh.cache[key] is CONFIGS[1]
    fresh.cache.clear()
    assert autotuned.seed_shipped("Toy GPU 1", __name__) == 0 and not fresh.cache  # once per process and prefix


def test_a_gpu_without_a_file_takes_one_of_its_architecture_by_the_nearest_name(fresh, tmp_path, monkeypatch):
    key = (40, "torch.float32", "torch.float32")
    _double_kernel.cache[key] = CONFIGS[0]
    recorded = autotuned.record(__name__, "Toy GPU 1", (9, 0))  # one scan of the process's objects: ~1 s
    _double_kernel.cache.clear()
    assert recorded["compute_capability"] == [9, 0]
    for name, config, capability in (("NVIDIA_H200", CONFIGS[0], [9, 0]), ("NVIDIA_H100_80GB_HBM3", CONFIGS[1], [9, 0]),
                                     ("NVIDIA_A100_SXM4_80GB", CONFIGS[0], [8, 0])):
        entries = [{**e, "config": config.all_kwargs()} for e in recorded["entries"]]
        (tmp_path / f"{name}.json").write_text(json.dumps({**recorded, "gpu": name, "compute_capability": capability,
                                                           "entries": entries}))
    monkeypatch.setattr(autotuned, "SHIPPED_DIR", tmp_path)
    find = autotuned.shipped_file
    assert find("NVIDIA H200", (9, 0)).stem == "NVIDIA_H200"  # its own file first
    assert find("NVIDIA H100 PCIe", (9, 0)).stem == "NVIDIA_H100_80GB_HBM3"  # the nearest name of its architecture
    assert find("NVIDIA H800", (9, 0)).stem == "NVIDIA_H100_80GB_HBM3"  # equal shares: the first by name
    assert find("NVIDIA GH200 480GB", (9, 0)).stem == "NVIDIA_H100_80GB_HBM3"
    assert find("NVIDIA A100-PCIE-40GB", (8, 0)).stem == "NVIDIA_A100_SXM4_80GB"
    assert find("NVIDIA L4", (8, 9)) is None and find("NVIDIA H100 PCIe") is None  # no kin; capability unknown
    monkeypatch.setattr(autotuned, "_SEEDED", set())
    assert autotuned.seed_shipped("NVIDIA H100 PCIe", __name__, (9, 0)) == 1 and fresh.cache[key] is CONFIGS[1]


def test_merged_recordings_keep_every_key_and_take_the_newer_choice():
    def entry(name, key, block):
        return {"module": "m", "name": name, "key": key, "config": {"BLOCK": block}}

    versions = {"triton": "3.6.0", "fla": "0.6.0"}
    old = {"gpu": "NVIDIA_H200", "versions": versions, "entries": [entry("a", [8, 16], 16), entry("b", [1], 32)]}
    new = {"gpu": "NVIDIA_H200", "versions": versions, "entries": [entry("a", [8, 16], 64), entry("a", [16, 48], 32)]}
    both = autotuned.merged(old, new)
    assert both["entries"] == [entry("a", [16, 48], 32), entry("a", [8, 16], 64), entry("b", [1], 32)]
    with pytest.raises(ValueError, match="NVIDIA_H100"):
        autotuned.merged(old, {**new, "gpu": "NVIDIA_H100"})
    with pytest.raises(ValueError, match="0.7.0"):
        autotuned.merged(old, {**new, "versions": {**versions, "fla": "0.7.0"}})
