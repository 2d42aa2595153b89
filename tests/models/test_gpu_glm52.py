"""glm52 on CUDA (skipped without it): the model's torch paths against the CPU in fp64, the Triton kernels
(DSA indexer scores, sparse MLA) against the torch paths in bf16 at glm52_mini's widths, and CPU-offloaded pages
against on-device pages."""

import collections

import pytest
import torch

import longstraw_kernels.dsa as dsa
from conftest import grads, ids, random_model, rel_err
from longstraw_cli.models import build_model
from longstraw_kernels import use_kernels
from longstraw_kernels.mla import dispatch as mla_dispatch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def run(model, prompt, response, offload=None, block_size=512):
    """Capture, then one differentiable replay with a weighted loss: -> (log-probs, parameter gradients)."""
    model.zero_grad(set_to_none=True)
    resident = model.capture(prompt, block_size=block_size, offload=offload)
    logp = model.logprobs(resident, response, grad=True)
    weights = torch.linspace(-1, 1, logp.numel(), device=logp.device, dtype=logp.dtype)
    (weights * logp).sum().backward()
    return logp.detach(), grads(model)


def test_fp64_on_cuda_equals_the_cpu():
    """Same weights, same prompt (longer than index_topk): the CUDA run in fp64 (torch paths: the kernels
    take bf16/fp32 only) gives the CPU's log-probs and gradients."""
    cpu = random_model("glm52_tiny")
    gpu = random_model("glm52_tiny").cuda()
    prompt, response = ids(700, 0), ids(40, 1)
    logp_cpu, g_cpu = run(cpu, prompt, response, block_size=128)
    logp_gpu, g_gpu = run(gpu, prompt.cuda(), response.cuda(), block_size=128)
    assert rel_err(logp_gpu.cpu(), logp_cpu) < 1e-10
    for name, g in g_cpu.items():
        if g.norm() > 0:
            assert rel_err(g_gpu[name].cpu(), g) < 1e-9, name


def mini(num_layers=3, seed=0):
    """glm52_mini's widths (MLA 512 + 64, 16 heads, indexer 16 x 128, top-k 2048, 32 experts) at 3 layers."""
    torch.manual_seed(seed)
    return build_model("glm52_mini", dtype=torch.bfloat16, device="cuda", seed=seed, num_hidden_layers=num_layers)


def test_triton_kernels_match_the_torch_paths_in_bf16(monkeypatch):
    """The whole model with the Triton indexer and sparse-MLA kernels against the same model on the torch
    paths, both in bf16, each measured against an fp32 run of the same weights (torch paths): the kernels'
    log-probs and gradients are as close to it as the torch paths' are (bf16 alone moves gradients by several
    percent through three layers, so the bar is relative to the torch paths' own error)."""
    model = mini()
    model32 = build_model("glm52_mini", dtype=torch.float32, device="cuda", num_hidden_layers=3)
    model32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (6001,), generator=g).cuda()
    response = torch.randint(0, model.config.vocab_size, (200,), generator=g).cuda()
    use_kernels(mla="torch")
    use_kernels(dsa="torch")
    logp32, g32 = run(model32, prompt, response, block_size=2048)
    del model32
    logp_torch, g_torch = run(model, prompt, response, block_size=2048)
    use_kernels(mla="auto")
    use_kernels(dsa="auto")
    # count what ran: every indexer call through the Triton scores, every sparse MLA call through Triton
    ran = collections.Counter()
    triton_scores = dsa._triton_scores()
    assert triton_scores is not None
    monkeypatch.setattr(dsa, "_triton_scores", lambda: lambda *a: (ran.update(["dsa"]), triton_scores(*a))[1])
    use_triton = mla_dispatch.use_triton
    monkeypatch.setattr(mla_dispatch, "use_triton", lambda *a: (ran.update([f"mla_{use_triton(*a)}"]),
                                                                 use_triton(*a))[1])
    logp, g_kernel = run(model, prompt, response, block_size=2048)
    assert ran["dsa"] > 0 and ran["mla_True"] > 0 and ran["mla_False"] == 0, ran

    names = [n for n in g32 if g32[n].norm() > 0]
    flat = lambda gs: torch.cat([gs[n].float().flatten() for n in names])  # noqa: E731
    err = {"logp_kernel": rel_err(logp.float(), logp32), "logp_torch": rel_err(logp_torch.float(), logp32),
           "grad_kernel": rel_err(flat(g_kernel), flat(g32)), "grad_torch": rel_err(flat(g_torch), flat(g32)),
           "grad_kernel_vs_torch": rel_err(flat(g_kernel), flat(g_torch))}
    print("glm52_mini x3 bf16 against fp32:", {k: f"{v:.2e}" for k, v in err.items()})
    assert err["logp_kernel"] < 1.5 * err["logp_torch"] + 1e-3, err
    assert err["grad_kernel"] < 1.5 * err["grad_torch"] + 1e-2, err


def test_grouped_expert_gemms_serve_on_the_gpu_and_match_the_loop(monkeypatch):
    """On an sm90 GPU in bf16 the experts run as grouped GEMMs (a run that cannot is a failure, not a skip); their
    output and gradients, idle experts included, are as close to the fp32 loop as the bf16 loop's are."""
    from longstraw_cli.models.glm52.experts import expert_ffn, grouped_mm_serves

    g = torch.Generator().manual_seed(0)
    L, C, I = 8, 2048, 768
    counts = [300, 0, 517, 1, 0, 1200, 64, 31]
    x32 = torch.randn(sum(counts), C, generator=g).cuda()
    gate_up32 = (torch.randn(L, 2 * I, C, generator=g) * C**-0.5).cuda()
    down32 = (torch.randn(L, C, I, generator=g) * I**-0.5).cuda()
    dy = torch.randn(sum(counts), C, generator=g).cuda()

    def run(dtype, grouped):
        leaves = [t.to(dtype).requires_grad_() for t in (x32, gate_up32, down32)]
        assert grouped_mm_serves(*leaves) == grouped
        y = expert_ffn(*leaves[:1], counts, *leaves[1:])
        return [y.float()] + [t.float() for t in torch.autograd.grad((y * dy.to(dtype)).sum(), leaves)]

    ref = run(torch.float32, False)
    grouped = run(torch.bfloat16, True)
    use_kernels(experts="torch")
    loop = run(torch.bfloat16, False)
    for name, r, gr, lo in zip(("y", "dx", "dgate_up", "ddown"), ref, grouped, loop):
        assert rel_err(gr, r) < 1.5 * rel_err(lo, r) + 1e-3, (name, rel_err(gr, r), rel_err(lo, r))
    # idle experts get zero gradients
    assert ref[2][1].abs().max() == 0 and grouped[2][1].abs().max() == 0 and grouped[3][4].abs().max() == 0


def test_offloaded_pages_match_on_device_pages():
    """offload=cpu (pinned host pages, staged a layer at a time) against pages on the GPU, bf16, kernels on."""
    model = mini(num_layers=2, seed=1)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (5001,), generator=g).cuda()
    response = torch.randint(0, model.config.vocab_size, (100,), generator=g).cuda()
    logp_dev, g_dev = run(model, prompt, response, block_size=2048)
    logp_off, g_off = run(model, prompt, response, offload="cpu", block_size=2048)
    assert rel_err(logp_off.float(), logp_dev.float()) < 5e-3
    for name, g in g_dev.items():
        if g.float().norm() > 0:
            assert rel_err(g_off[name].float(), g.float()) < 5e-2, name
