"""The Triton chunked GDN (kernels/gdn/triton_chunk.py) against the torch reference gdn_chunked in fp64: outputs,
final state and the gradient of every input (initial state included) under cotangents on o and on the final state.

Small cases run everywhere: on CPU in Triton's interpreter (conftest sets TRITON_INTERPRET=1), on a GPU compiled.
qwen36 sizes in bf16 and fp32 need CUDA. Also the dispatch: which path gdn_forward takes.
"""

import pytest
import torch

from conftest import gdn_inputs, rel_err
from longstraw_kernels import use_kernels
from longstraw_kernels.gdn import fla_gpu, gdn_chunked, gdn_forward, triton_chunk

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
NAMES = ("q", "k", "v", "g", "beta", "state")

pytestmark = pytest.mark.usefixtures("one_thread")


def make_inputs(B, T, H, G, K, V, with_state=True, seed=0):
    """`gdn_inputs` (fp64 leaves) on DEVICE."""
    inputs = gdn_inputs(B, T, H, G, K, V, with_state=with_state, seed=seed)
    return {n: None if t is None else t.to(DEVICE) for n, t in inputs.items()}


def cotangents(x, seed=1):
    """Random fp64 cotangents for o [B, T, G, V] and the final state [B, G, K, V]."""
    gen = torch.Generator().manual_seed(seed)
    B, T, G, V = x["v"].shape
    K = x["k"].shape[-1]
    return (torch.randn(B, T, G, V, generator=gen, dtype=torch.float64).to(DEVICE),
            torch.randn(B, G, K, V, generator=gen, dtype=torch.float64).to(DEVICE))


def run(fn, x, dtypes, grad_names, cot, chunk_size):
    """fn on x cast to dtypes (name -> dtype, fp32 by default), leaves in grad_names requiring grad; backward of
    <o, do> + <final, dfinal> (either cotangent None: left out) -> (o, final, {name: grad})."""
    leaves = {n: None if t is None else t.to(dtypes.get(n, torch.float32)).requires_grad_(n in grad_names)
              for n, t in x.items()}
    o, final = fn(*(leaves[n] for n in NAMES), chunk_size=chunk_size)
    do, dfinal = cot
    loss = 0
    if do is not None:
        loss = loss + (o.double() * do).sum()
    if dfinal is not None:
        loss = loss + (final.double() * dfinal).sum()
    loss.backward()
    return o, final, {n: leaves[n].grad for n in grad_names}


def compare(x, chunk_size, dtypes=None, grad_names=NAMES, cot=None):
    """-> {name: rel err} of the Triton op against gdn_chunked in fp64 on the same (rounded) values; checks dtypes."""
    dtypes = dtypes or {}
    grad_names = [n for n in grad_names if x[n] is not None]
    cot = cot or cotangents(x)
    o, final, grads = run(triton_chunk.gdn_chunked_triton, x, dtypes, grad_names, cot, chunk_size)
    rounded = {n: None if t is None else t.to(dtypes.get(n, torch.float32)).double() for n, t in x.items()}
    o_ref, final_ref, grads_ref = run(gdn_chunked, rounded, {n: torch.float64 for n in NAMES}, grad_names, cot,
                                      chunk_size)
    assert o.dtype == dtypes.get("v", torch.float32) and final.dtype == torch.float32
    assert all(grads[n].dtype == dtypes.get(n, torch.float32) for n in grad_names)
    errs = {"o": rel_err(o, o_ref), "final": rel_err(final, final_ref)}
    return errs | {f"d{n}": rel_err(grads[n], grads_ref[n]) for n in grad_names}


def fmt(errs):
    return ", ".join(f"{n} {e:.1e}" for n, e in errs.items())


@pytest.mark.parametrize("with_state", [True, False])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("T, chunk_size", [(1, 16), (7, 16), (40, 16), (48, 16), (70, 64)])
def test_fp32_matches_chunked_fp64(T, chunk_size, group, with_state):
    # K = 8, V = 6 pad to the kernels' 16; T = 40, 70 leave a partial last chunk; T = 1, 7 a single short one
    x = make_inputs(B=2, T=T, H=2, G=2 * group, K=8, V=6, with_state=with_state, seed=T + group)
    # one token decaying a zero initial state: g's gradient is zero (rounding-level in the reference)
    grad_names = [n for n in NAMES if not (n == "g" and T == 1 and not with_state)]
    errs = compare(x, chunk_size, grad_names=grad_names)
    print(f"triton GDN fp32 T={T} C={chunk_size} G/H={group} state={with_state}: {fmt(errs)}")
    assert max(errs.values()) < 1e-5


@pytest.mark.parametrize("block_v", [16, 64])
def test_value_blocks_and_key_padding(monkeypatch, block_v):
    # V = 40: three programs of 16 value columns (the last masked after 8), or one of 64; K = 20 pads to 32
    monkeypatch.setattr(triton_chunk, "DEFAULT_CONFIG", triton_chunk.ScanConfig(block_v, 4, 1))
    x = make_inputs(B=1, T=35, H=1, G=2, K=20, V=40, seed=3)
    errs = compare(x, 16)
    print(f"triton GDN BV={block_v}: {fmt(errs)}")
    assert max(errs.values()) < 1e-5


@pytest.mark.parametrize("which", ["o only", "final only"])
def test_one_cotangent(which):
    x = make_inputs(B=1, T=37, H=2, G=4, K=8, V=6, seed=4)
    do, dfinal = cotangents(x)
    if which == "o only":
        errs = compare(x, 16, cot=(do, None))
    else:
        # the final state does not depend on q
        errs = compare(x, 16, grad_names=NAMES[1:], cot=(None, dfinal))
    print(f"triton GDN {which}: {fmt(errs)}")
    assert max(errs.values()) < 1e-5


@pytest.mark.parametrize("grad_names", [("state",), ("v", "g"), ("q",)])
def test_some_inputs_need_grad(grad_names):
    x = make_inputs(B=1, T=21, H=1, G=2, K=8, V=6, seed=5)
    errs = compare(x, 16, grad_names=grad_names)
    assert set(errs) == {"o", "final"} | {f"d{n}" for n in grad_names}
    assert max(errs.values()) < 1e-5


def test_half_precision_inputs_on_the_interpreter():
    # bf16 q, k, v reach the kernels as fp32 terms, so the interpreter runs them too. o in bf16 rounds o and its
    # cotangent (the fp64 reference's are not), so every gradient is off by bf16 rounding; the final state is not
    x = make_inputs(B=1, T=30, H=1, G=2, K=8, V=6, seed=6)
    errs = compare(x, 16, dtypes={"q": torch.bfloat16, "k": torch.bfloat16, "v": torch.bfloat16})
    print(f"triton GDN bf16 q, k, v: {fmt(errs)}")
    assert errs.pop("final") < 1e-5 and max(errs.values()) < 1e-2


def test_saves_only_the_inputs():
    x = make_inputs(B=1, T=40, H=1, G=2, K=8, V=6, seed=7)
    leaves = [None if t is None else t.float().requires_grad_() for t in x.values()]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        triton_chunk.gdn_chunked_triton(*leaves, chunk_size=16)
    assert [t.data_ptr() for t in saved] == [t.data_ptr() for t in leaves]


def test_forward_values_from_another_kernel():
    """forward=fn (fla's chunked kernel on a GPU): the op's values are fn's, computed without a graph, and its
    gradients are its own backward's, the same with or without fn."""
    x = make_inputs(B=1, T=29, H=1, G=2, K=8, V=6, seed=10)
    cot = cotangents(x)
    calls = []

    def forward(*args):
        calls.append(torch.is_grad_enabled())
        o, final = gdn_chunked(*args, chunk_size=16)
        return o + 1.0, final  # marked, so the values are seen to be fn's

    def op(*args, chunk_size):
        return triton_chunk.gdn_chunked_triton(*args, chunk_size=chunk_size, forward=forward)

    o, final, grads = run(op, x, {}, NAMES, cot, 16)
    o_own, final_own, grads_own = run(triton_chunk.gdn_chunked_triton, x, {}, NAMES, cot, 16)
    assert calls == [False]
    assert rel_err(o - 1.0, o_own) < 1e-5 and rel_err(final, final_own) < 1e-5
    assert all(torch.equal(grads[n], grads_own[n]) for n in NAMES)


def test_rejects_what_it_does_not_take():
    x = make_inputs(B=1, T=4, H=1, G=1, K=8, V=6, seed=8)
    args = list(x.values())
    assert triton_chunk.supported(*args[:5], chunk_size=16) is False  # fp64 computes in fp64
    args32 = [t.float() for t in args]
    assert triton_chunk.supported(*args32, chunk_size=16)
    assert not triton_chunk.supported(*args32, chunk_size=24)
    assert not triton_chunk.supported(*args32, chunk_size=8)
    with pytest.raises(ValueError, match="power of two"):
        triton_chunk.gdn_chunked_triton(*args32, chunk_size=24)


def test_dispatch():
    x = make_inputs(B=1, T=20, H=1, G=2, K=8, V=6, seed=9)
    args = [t.float().requires_grad_() for t in x.values()]
    assert fla_gpu.use_triton(*args) == (DEVICE == "cuda")
    assert not fla_gpu.use_triton(*[t.double() for t in args])
    use_kernels(gdn="torch")
    assert not fla_gpu.use_triton(*args)


# -- qwen36 sizes on the GPU --------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T, H, G", [(1, 8, 16), (1000, 8, 16), (4096, 2, 4)])
def test_cuda_bf16_qwen36_sizes(T, H, G):
    # the model's dtypes: q, k fp32 (l2norm in fp32), v bf16, g and beta fp32, state fp32
    x = make_inputs(B=1, T=T, H=H, G=G, K=128, V=128, seed=T)
    errs = compare(x, 64, dtypes={"v": torch.bfloat16})
    print(f"triton GDN cuda bf16 T={T} H={H} G={G}: {fmt(errs)}")
    # o and its cotangent in bf16 (see the interpreter's bf16 test)
    assert errs.pop("final") < 1e-4 and max(errs.values()) < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 1000, 4096])
def test_cuda_gdn_forward_with_grad_bf16(T):
    """What a replay and exact mode's walk run: gdn_forward with a gradient, v bf16 (fla's forward values, our
    backward), against gdn_chunked in fp64 on the same values."""
    x = make_inputs(B=1, T=T, H=2, G=4, K=128, V=128, seed=T)

    def op(*args, chunk_size):
        return gdn_forward(*args, chunk_size=chunk_size)

    cot = cotangents(x)
    o, final, grads = run(op, x, {"v": torch.bfloat16}, NAMES, cot, 64)
    rounded = {n: None if t is None else t.to(torch.bfloat16 if n == "v" else torch.float32).double()
               for n, t in x.items()}
    o_ref, final_ref, grads_ref = run(gdn_chunked, rounded, {n: torch.float64 for n in NAMES}, NAMES, cot, 64)
    errs = {"o": rel_err(o, o_ref), "final": rel_err(final, final_ref)}
    errs |= {f"d{n}": rel_err(grads[n], grads_ref[n]) for n in NAMES}
    print(f"gdn_forward with grad, cuda bf16 T={T}: {fmt(errs)}")
    # fla's kernel computes with q and k rounded to bf16 (our op keeps them fp32): bf16 noise on o and the state
    assert max(errs.values()) < 2e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [63, 2000])
def test_cuda_fp32_is_ieee(T):
    # fp32 dots must not be TF32 (which would give ~1e-3)
    x = make_inputs(B=2, T=T, H=2, G=4, K=128, V=128, seed=T)
    errs = compare(x, 64)
    print(f"triton GDN cuda fp32 T={T}: {fmt(errs)}")
    assert max(errs.values()) < 1e-4


@pytest.mark.gpu
@needs_cuda
def test_cuda_gdn_forward_takes_triton_with_grad(monkeypatch):
    calls = []
    op = triton_chunk.gdn_chunked_triton
    monkeypatch.setattr(triton_chunk, "gdn_chunked_triton",
                        lambda *a, **kw: calls.append(kw["forward"]) or op(*a, **kw))
    x = make_inputs(B=1, T=300, H=2, G=4, K=128, V=128, seed=1)
    args = [t.float() for t in x.values()]
    args[2] = args[2].bfloat16().requires_grad_()
    o, final = gdn_forward(*args)
    (o.float().sum() + final.sum()).backward()
    # bf16 v with fla installed: the forward values come from fla's kernel (a GPU run has fla: test_gpu.py fails
    # without it)
    assert len(calls) == 1 and calls[0] is not None and args[2].grad is not None
    with torch.no_grad():
        gdn_forward(*args[:2], args[2].float(), *args[3:])
    use_kernels(gdn="torch")
    gdn_forward(*args)
    assert len(calls) == 1
