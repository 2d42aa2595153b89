"""QLoRA (`lora.quantize=nf4`, quantize.py): an NF4 model computes what the same model computes with its
dequantised weights put back as plain tensors, on every path that reads weights (full forward, capture + replay,
scoring, native rollout, the reference with adapters off); its adapter (and glm52 router) gradients are the
dequantised model's; glm52's routed experts are NF4 expert by expert, dequantised only where routed (a few at a
time in the static decode step), and under expert parallel (gloo, 2 ranks) equal one rank; it is built and loaded
one decoder layer at a time; `longstraw plan` counts its bytes as torchao stores them.

The "dequantised model" is an independent build (the plain path, `build_model` without quantize) with the NF4
model's weights dequantised into it through `load_state_dict`."""

import pytest
import torch

pytest.importorskip("torchao")

from conftest import ids, rel_err
from longstraw_cli import quantize
from longstraw_cli.lora import LoraConfig, adapters_disabled, apply_lora, lora_layers, lora_state_dict
from longstraw_cli.models import build_model, from_pretrained
from longstraw_cli.quantize import dense, is_nf4, is_nf4_experts, quantized_experts, quantized_linears, storage_bytes
from longstraw_cli.rollout.native import NativeConfig, SamplingConfig, generate

FAMILIES = ("qwen36_tiny", "glm52_tiny")
# within the dtype's noise: the NF4 linear dequantises to the activations' dtype, the plain one reads that tensor
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}


def dequantised(model: torch.nn.Module, name: str, dtype: torch.dtype) -> torch.nn.Module:
    """The plain build of `name` holding `model`'s weights, NF4 ones dequantised (and its adapters, if any)."""
    plain = build_model(name, dtype=dtype)
    if lora_layers(model):
        rank = next(iter(lora_layers(model).values())).rank
        apply_lora(plain, LoraConfig(rank=rank, alpha=4.0))
    plain.load_state_dict({k: dense(v) for k, v in model.state_dict().items()})
    assert quantized_linears(plain) == quantized_experts(plain) == 0
    return plain


def nf4_model(name: str, dtype: torch.dtype, rank: int = 0) -> torch.nn.Module:
    model = build_model(name, dtype=dtype, seed=3, quantize="nf4")
    if rank:
        apply_lora(model, LoraConfig(rank=rank, alpha=4.0, quantize="nf4"))
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            # B random: fresh adapters (B = 0) would leave the adapter path out of every comparison
            for layer in lora_layers(model).values():
                layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g) * 0.05)
    return model


@pytest.mark.parametrize("name", FAMILIES)
def test_every_base_linear_and_expert_of_the_layers_is_nf4_and_nothing_else(name):
    model = nf4_model(name, torch.float32)
    nf4 = {n for n, p in model.named_parameters() if is_nf4(p)}
    assert nf4 and all(n.startswith("model.layers.") and n.endswith(".weight") for n in nf4)
    # never embeddings, lm_head, norms, the router or the DSA indexer
    assert not any(k in n for n in nf4 for k in ("norm", "embed", "lm_head", ".gate.weight", "indexer"))
    linears = {f"{n}.weight" for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n.startswith("model.layers.") and ".indexer." not in n}
    assert nf4 == linears
    # 4-bit codes plus scalers: well under a third of fp32's bytes for those weights
    params = dict(model.named_parameters())
    assert sum(storage_bytes(params[n]) for n in nf4) < sum(params[n].numel() * 4 for n in nf4) / 6
    # glm52's routed experts: every expert its own NF4 matrix, stored as nf4_bytes says, expert by expert
    experts = {n for n, p in params.items() if is_nf4_experts(p)}
    assert experts == {n for n in params if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))}
    assert bool(experts) == name.startswith("glm52")
    for n in experts:
        w = params[n]
        assert all(is_nf4(e) and e.shape == w.shape[1:] for e in w.unbind(0)) and not w.requires_grad
        assert storage_bytes(w) == w.shape[0] * quantize.nf4_bytes(w[0].numel(), w.element_size())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("name", FAMILIES)
def test_nf4_paths_equal_the_dequantised_model(name, dtype, monkeypatch):
    """Full forward, capture + log-probs (scoring), native rollout and the reference (adapters off). glm52's
    decode step reads its 8 NF4 experts in passes of 3, 3 and 2."""
    monkeypatch.setattr(quantize, "NF4_EXPERTS_PER_PASS", 3)
    model = nf4_model(name, dtype, rank=2)
    plain = dequantised(model, name, dtype)
    tol = TOLERANCE[dtype]
    x = ids(70, seed=1)
    assert rel_err(model(x).float(), plain(x).float()) <= tol

    prompt, response = ids(61, seed=2), ids(9, seed=3)
    with torch.no_grad():
        got = model.logprobs(model.capture(prompt, block_size=16), response)
        want = plain.logprobs(plain.capture(prompt, block_size=16), response)
    assert rel_err(got, want) <= tol
    with adapters_disabled(model), adapters_disabled(plain), torch.no_grad():
        base = model(x).float()
        assert rel_err(base, plain(x).float()) <= tol
    # the adapters are part of what the comparisons above saw
    assert rel_err(base, model(x).float()) > 10 * tol

    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0)
    rollouts = [generate(m, m.capture(prompt, block_size=16), 3, sampling, torch.Generator().manual_seed(0),
                         NativeConfig(cuda_graph=False)) for m in (model, plain)]
    if dtype != torch.bfloat16:
        # same logits, same generator: the same tokens
        assert [r.tolist() for r in rollouts[0].responses] == [r.tolist() for r in rollouts[1].responses]
        assert rel_err(torch.cat(rollouts[0].logprobs), torch.cat(rollouts[1].logprobs)) <= tol


def routers_trained(model: torch.nn.Module) -> set[str]:
    """glm52's router weights made trainable (frozen by apply_lora): the experts' backward must reach them
    through the routing weights. -> their names."""
    names = {n for n, _ in model.named_parameters() if n.endswith(".mlp.gate.weight")}
    for n, p in model.named_parameters():
        p.requires_grad_(p.requires_grad or n in names)
    return names


@pytest.mark.parametrize("name", FAMILIES)
def test_adapter_gradients_equal_the_dequantised_model(name):
    from conftest import response_only_grads

    model = nf4_model(name, torch.float32, rank=2)
    plain = dequantised(model, name, torch.float32)
    routers = routers_trained(model)
    assert routers_trained(plain) == routers and bool(routers) == name.startswith("glm52")
    prompt, responses = ids(57, seed=4), [ids(7, seed=5), ids(5, seed=6)]
    weights = [torch.linspace(-1, 1, 7), torch.linspace(0.5, 1, 5)]
    got = response_only_grads(model, prompt, responses, weights, block_size=20)
    want = response_only_grads(plain, prompt, responses, weights, block_size=20)
    # adapters and routers only: never a frozen base weight, NF4 linear or expert
    assert set(got) == set(want) == set(lora_state_dict(model)) | routers
    worst = max(rel_err(got[k], want[k]) for k in want)
    print(f"{name}: adapter and router gradients, NF4 vs dequantised, max rel {worst:.1e}")
    assert worst <= 1e-5
    assert all(got[k].norm() > 0 for k in routers)


def test_quantisation_loses_what_nf4_loses_and_no_more():
    """Against the weights before quantisation: the NF4 error of normal weights (~10% RMS at 4 bits)."""
    model = build_model("qwen36_tiny", seed=3, quantize="nf4")
    w = model.model.layers[0].mlp.up_proj.weight
    original = torch.randn(w.shape, generator=torch.Generator().manual_seed(0)) * 0.02
    q = quantize.torchao_nf4().to_nf4(original, 64, quantize.scaler_block_size(original.numel()))
    assert 0.02 < rel_err(dense(q), original) < 0.15


@pytest.mark.parametrize("name", FAMILIES)
def test_built_and_loaded_one_layer_at_a_time(name, tmp_path, monkeypatch):
    """When layer i is quantised, layers > i are not yet allocated and layers < i hold NF4 weights only."""
    from longstraw_cli import models

    seen = []

    def spy(part):
        model = spy.model
        layers = list(model.model.layers)
        i = next(j for j, layer in enumerate(layers) if layer is part)
        later = [p.is_meta for layer in layers[i + 1:] for p in layer.parameters()]
        earlier_dense = [n for layer in layers[:i] for n, m in layer.named_modules()
                         if isinstance(m, torch.nn.Linear) and ".indexer" not in f".{n}" and not is_nf4(m.weight)]
        # glm52's routed experts are quantised with their layer too
        earlier_dense += [n for layer in layers[:i] for n, p in layer.named_parameters()
                          if n.endswith(("gate_up_proj", "down_proj")) and not is_nf4_experts(p)]
        seen.append((i, all(later), earlier_dense))
        return real(part)

    real = quantize.quantize_linears
    monkeypatch.setattr(models, "quantize_linears", spy)
    original_on_meta = models._on_meta

    def on_meta(*args):
        spy.model = original_on_meta(*args)
        return spy.model

    monkeypatch.setattr(models, "_on_meta", on_meta)
    built = build_model(name, seed=0, quantize="nf4")
    num_layers = len(built.model.layers)
    assert seen == [(i, True, []) for i in range(num_layers)]

    if name.startswith("glm52"):
        # the loader path is the same code; glm52's NF4 export: tests/models/test_glm52_export.py
        return
    from longstraw_cli.export import export_hf

    plain = build_model(name, seed=0)
    export_hf(plain, tmp_path / "hf")
    seen.clear()
    loaded = from_pretrained(tmp_path / "hf", quantize="nf4")
    assert seen == [(i, True, []) for i in range(num_layers)]
    # the loaded model is the plain one's weights, each base linear quantised, the rest as saved
    nf4 = quantize.torchao_nf4()
    want = plain.state_dict()
    for key, got in loaded.state_dict().items():
        if is_nf4(got):
            w = want[key]
            assert torch.equal(dense(got), dense(nf4.to_nf4(w, 64, quantize.scaler_block_size(w.numel())))), key
        else:
            assert torch.equal(got, want[key]), key


def test_export_writes_dequantised_merged_weights(tmp_path):
    from longstraw_cli.export import export_hf

    model = nf4_model("qwen36_tiny", torch.float32, rank=2)
    export_hf(model, tmp_path / "hf")
    reloaded = from_pretrained(tmp_path / "hf")
    assert quantized_linears(reloaded) == 0
    x = ids(33, seed=10)
    with torch.no_grad():
        assert rel_err(reloaded(x), model(x)) <= 1e-5


@pytest.mark.parametrize("bad, expected", [
    (dict(rank=0, quantize="nf4"), "needs lora.rank > 0, got lora.rank=0"),
    (dict(rank=4, quantize="int4"), "lora.quantize='int4'; valid: ['none', 'nf4']"),
])
def test_bad_lora_config_is_one_line(bad, expected):
    with pytest.raises(ValueError) as e:
        LoraConfig(**bad)
    assert expected in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name, overrides, dtype", [
    ("qwen36_tiny", {}, "float32"),
    # qwen36_mini's widths (every linear 256 scalers a factor, as on the 27B shape), a GDN and a full-attention
    # layer, a small vocab
    pytest.param("qwen36_mini", {"num_hidden_layers": 2, "full_attention_interval": 2, "vocab_size": 1024},
                 "bfloat16", marks=pytest.mark.slow),
], ids=["tiny", "mini_widths"])
def test_plan_counts_the_bytes_torchao_stores(name, overrides, dtype):
    """plan's weights for quantize=nf4 equal the measured storage of every parameter, NF4 inner tensors
    included, adapters too."""
    from longstraw_cli.models.qwen36.config import named_config
    from longstraw_cli.plan import plan

    model = build_model(name, dtype=getattr(torch, dtype), seed=0, quantize="nf4", **overrides)
    apply_lora(model, LoraConfig(rank=16, quantize="nf4"))
    measured = sum(storage_bytes(p) for p in model.parameters())
    cfg = named_config(name, **overrides)
    common = dict(prompt_tokens=1024, group_size=2, response_tokens=16, dtype=dtype, lora_rank=16)
    planned = plan(cfg, quantize="nf4", **common)
    assert planned["weights"] == measured
    assert planned["weights"] < plan(cfg, **common)["weights"]


def test_nf4_cache_is_on_by_default_for_qlora_only():
    """rollout.native.nf4_cache=auto (the default) caches with lora.quantize=nf4 and only then; true and false
    override it (true without nf4 is refused by the config: tests/e2e/test_cli.py)."""
    assert NativeConfig().caches_nf4("nf4") and not NativeConfig().caches_nf4("none")
    assert not NativeConfig(nf4_cache=False).caches_nf4("nf4")
    assert NativeConfig(nf4_cache=True).caches_nf4("nf4")
    with pytest.raises(ValueError, match="true, false or auto, got 'on'"):
        NativeConfig(nf4_cache="on")


@pytest.mark.parametrize("name", FAMILIES)
def test_dense_copies_decode_the_same_and_put_the_nf4_weights_back(name):
    """rollout.native.nf4_cache's copies: a rollout with some or all NF4 linears held dequantised samples the
    same tokens with the same log-probs (the products multiply by the same values), and the NF4 Parameters are
    back afterwards."""
    model = nf4_model(name, torch.float32, rank=2)
    originals = {n: p for n, p in model.named_parameters() if is_nf4(p)}
    prompt = ids(61, seed=2)
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0)

    def rollout():
        return generate(model, model.capture(prompt, block_size=16), 3, sampling, torch.Generator().manual_seed(0),
                        NativeConfig(cuda_graph=False))

    want = rollout()
    total = len(quantize.nf4_modules(model))
    assert total == len(originals)
    for count in (5, total):
        with quantize.dense_copies(model, count) as held:
            assert held == count and quantized_linears(model) == total - count
            got = rollout()
        assert [r.tolist() for r in got.responses] == [r.tolist() for r in want.responses]
        assert all(torch.equal(a, b) for a, b in zip(got.logprobs, want.logprobs))
        assert {n: p for n, p in model.named_parameters() if is_nf4(p)} == originals


def test_dense_cache_keeps_its_first_size_and_only_shrinks():
    model = nf4_model("qwen36_tiny", torch.float32)
    sizes = [m.weight.numel() * 4 for m in quantize.nf4_modules(model)]
    cache = quantize.DenseCache()
    assert cache.size(model, sum(sizes[:3]) + 1) == (3, sum(sizes[:3]), True)
    # more room later: the same count (the compiled decode step keeps its weights)
    assert cache.size(model, 10 * sum(sizes)) == (3, sum(sizes[:3]), False)
    assert cache.size(model, sum(sizes[:1])) == (1, sizes[0], True)
    assert cache.size(model, -5) == (0, 0, True)
    with quantize.dense_copies(model, 0) as held:
        assert held == 0 and quantized_linears(model) == len(sizes)


def test_experts_dequantise_only_the_routed_ones_and_never_all_at_once(monkeypatch):
    """A MoE call dequantises each expert its tokens are routed to once (and again in its backward), no other;
    the static decode step reads NF4 experts `experts_per_pass` at a time."""
    from longstraw_cli.models.glm52 import experts as experts_module
    from longstraw_kernels import nf4 as nf4_ops

    model = nf4_model("glm52_tiny", torch.float64, rank=2)
    moe = model.model.layers[1].mlp
    E = moe.experts.gate_up_proj.shape[0]
    x_NC = torch.randn(3, model.config.hidden_size, dtype=torch.float64, requires_grad=True)
    topk_idx_Nk, topk_w_Nk = moe.gate(x_NC)
    routed = len(topk_idx_Nk.unique())
    assert routed < E
    shapes = []
    real_dequantize = nf4_ops.dequantize
    monkeypatch.setattr(nf4_ops, "dequantize", lambda parts: shapes.append(parts.shape) or real_dequantize(parts))
    y_NC = moe.experts_fn(x_NC, topk_idx_Nk, topk_w_Nk, moe.experts.gate_up_proj, moe.experts.down_proj)
    gate_up, down = tuple(moe.experts.gate_up_proj.shape[1:]), tuple(moe.experts.down_proj.shape[1:])
    assert sorted(shapes) == sorted([gate_up, down] * routed)
    shapes.clear()
    y_NC.sum().backward()
    assert sorted(shapes) == sorted([gate_up, down] * routed) and x_NC.grad.norm() > 0

    monkeypatch.setattr(quantize, "NF4_EXPERTS_PER_PASS", 3)
    passes = []
    real_dense = experts_module.dense
    monkeypatch.setattr(experts_module, "dense", lambda w: passes.append(w.shape[0]) or real_dense(w))
    with torch.no_grad():
        dense_y_NC = experts_module.dense_experts(x_NC, topk_idx_Nk, topk_w_Nk, moe.experts.gate_up_proj,
                                                  moe.experts.down_proj)
    assert passes == [3, 3, 3, 3, 2, 2] and rel_err(dense_y_NC, y_NC) <= 1e-12


def _nf4_run(model, capture):
    """Scores, adapter and router gradients, and a rollout of an NF4 glm52 model (the EP test's record)."""
    g = torch.Generator().manual_seed(11)
    prompt, response = torch.randint(0, 259, (61,), generator=g), torch.randint(0, 259, (9,), generator=g)
    resident = capture(prompt)
    scores = model.logprobs(resident, response)
    model.zero_grad(set_to_none=True)
    (torch.linspace(-1, 1, 9, dtype=torch.float64) * model.logprobs(resident, response, grad=True)).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    rollout = generate(model, resident, 3, SamplingConfig(max_new_tokens=6), torch.Generator().manual_seed(5),
                       NativeConfig(cuda_graph=False))
    return {"scores": scores, "grads": grads, "responses": rollout.responses, "logprobs": rollout.logprobs}


def _nf4_ep_worker(rank, world, port, out_dir):
    import os

    import torch.distributed as dist

    from conftest import join_gloo
    from longstraw_cli.distributed.cp import apply_context_parallel
    from longstraw_cli.distributed.ep import apply_expert_parallel

    join_gloo(rank, world, port)
    model = nf4_model("glm52_tiny", torch.float64, rank=2)
    routers_trained(model)
    full = {n: dense(p) for n, p in model.named_parameters() if is_nf4_experts(p)}
    # context parallel too: the capture's experts take the all-to-all, replay, scoring and decode the all-reduce
    apply_context_parallel(model, dist.group.WORLD)
    apply_expert_parallel(model, dist.group.WORLD, cp_group=dist.group.WORLD)
    experts = {n: p for n, p in model.named_parameters() if n in full}
    result = _nf4_run(model, lambda p: model.capture(p, block_size=16))
    half = next(iter(full.values())).shape[0] // world
    # this rank's NF4 experts are its slice of the one-rank ones, bit for bit
    result["slices_ok"] = experts.keys() == full.keys() and all(
        is_nf4_experts(p) and torch.equal(dense(p), full[n][rank * half:(rank + 1) * half])
        for n, p in experts.items())
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
def test_nf4_experts_under_expert_parallel_equal_one_rank(tmp_path):
    """cp=2 x ep=2 (gloo) against one rank, both NF4: scores, adapter and router gradients, the rollout."""
    from conftest import rank_results

    model = nf4_model("glm52_tiny", torch.float64, rank=2)
    routers_trained(model)
    want = _nf4_run(model, lambda p: model.capture(p, block_size=16))
    for got in rank_results(_nf4_ep_worker, 2, tmp_path, timeout_s=600):
        assert got["slices_ok"]
        assert rel_err(got["scores"], want["scores"]) <= 1e-10
        assert got["grads"].keys() == want["grads"].keys() and any(".mlp.gate." in k for k in want["grads"])
        assert max(rel_err(got["grads"][k], want["grads"][k]) for k in want["grads"]) <= 1e-10
        assert [r.tolist() for r in got["responses"]] == [r.tolist() for r in want["responses"]]
        assert rel_err(torch.cat(got["logprobs"]), torch.cat(want["logprobs"])) <= 1e-10


def test_glm52_decode_is_compiled_over_plain_experts_only():
    """The static decode step is compiled (on CUDA) where it is graph-safe, but not over NF4 experts: compiling
    their dequantisation has not run on a GPU."""
    prompt = torch.randint(0, 259, (40,), generator=torch.Generator().manual_seed(2))
    for weights, compiled in (("none", True), ("nf4", False)):
        model = build_model("glm52_tiny", seed=3, quantize=weights)
        decoder = model.decoder(model.capture(prompt, block_size=16), 2, 8)
        assert decoder.graph_safe and decoder.compile_safe is compiled, weights
