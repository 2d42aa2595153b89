"""sparse_mla_attention for any device: the Triton kernels (triton_sparse.py) when q and the pages are on one
CUDA device in one dtype among bf16 / fp16 / fp32 and Triton imports, the torch reference everywhere else (CPU,
fp64, mixed dtypes). Same signature, same saved-tensor contract. Pages in host memory (an offloaded rollout) with
q on a GPU: the distinct selected rows move to q's device first (`selected_rows`), then the same choice; pages
that need a gradient there take the reference, which gathers per chunk.

`kernels.mla` = auto (default) | torch: torch forces the reference (A/B benchmarks, or a fallback should the
kernel misbehave). Under auto the backward is Triton's too: dq, and the pages' gradients where they need one
(see triton_sparse.TritonSparseMLA).
"""

from __future__ import annotations

import torch

from longstraw_kernels import compute_dtype, kernel_choice, needs_grad, optional_module
from longstraw_kernels.mla import reference


def triton_module():
    """longstraw_kernels.mla.triton_sparse, or None where Triton does not import."""
    return optional_module("longstraw_kernels.mla.triton_sparse")


def use_triton(q_BTHA, latent_PL, rope_PR, idx_BTK) -> bool:
    if kernel_choice("mla") == "torch":
        return False
    if not (q_BTHA.is_cuda and latent_PL.device == q_BTHA.device and rope_PR.device == q_BTHA.device):
        return False
    module = triton_module()
    return module is not None and module.supported(q_BTHA, latent_PL, rope_PR, idx_BTK)


def sparse_mla_attention(q_BTHA, latent_PL, rope_PR, idx_BTK, *, scale):
    """-> (out_BTHL in q's dtype, lse_BTH); see `reference.sparse_mla_attention`. Inside a compiled graph (the
    decode step, no gradient) it is one opaque op (`longstraw::sparse_mla_forward`): inductor does not re-trace
    the Triton kernel, and dynamo does not break the graph there, so the page count stays a dynamic size."""
    if torch.compiler.is_compiling():
        return _forward_op(q_BTHA, latent_PL, rope_PR, idx_BTK, scale)
    return _sparse_mla_attention(q_BTHA, latent_PL, rope_PR, idx_BTK, scale)


def _sparse_mla_attention(q_BTHA, latent_PL, rope_PR, idx_BTK, scale):
    reference.check_shapes(q_BTHA, latent_PL, rope_PR, idx_BTK)
    if latent_PL.device != q_BTHA.device and not (latent_PL.requires_grad or rope_PR.requires_grad):
        # pages in host memory (an offloaded rollout): only the selected rows cross, each once
        latent_PL, rope_PR, idx_BTK = selected_rows(latent_PL, rope_PR, idx_BTK, q_BTHA.device)
    if use_triton(q_BTHA, latent_PL, rope_PR, idx_BTK):
        return triton_module().TritonSparseMLA.apply(q_BTHA, latent_PL, rope_PR, idx_BTK, scale)
    return reference._SparseMLA.apply(q_BTHA, latent_PL, rope_PR, idx_BTK, scale)


# forward only: the compiled decode step computes no gradient (a backward through it is an error of torch's)
@torch.library.custom_op("longstraw::sparse_mla_forward", mutates_args=())
def _forward_op(q_BTHA: torch.Tensor, latent_PL: torch.Tensor, rope_PR: torch.Tensor, idx_BTK: torch.Tensor,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return _sparse_mla_attention(q_BTHA, latent_PL, rope_PR, idx_BTK, scale)


@_forward_op.register_fake
def _fake_forward(q_BTHA, latent_PL, rope_PR, idx_BTK, scale):
    B, T, H, _ = q_BTHA.shape
    out_BTHL = q_BTHA.new_empty(B, T, H, latent_PL.shape[-1])
    return out_BTHL, q_BTHA.new_empty(B, T, H, dtype=compute_dtype(q_BTHA, latent_PL, rope_PR))


def sparse_mla_two_sources(q_BTHA, latent_PL, rope_PR, new_latent_NL, new_rope_NR, idx_BTK, slots: int, *, scale,
                           attention_fn=sparse_mla_attention):
    """`reference.sparse_mla_two_sources` (the decode's prompt pages and response keys): one Triton launch (and its
    split parts' combine) over both sources where `attention_fn` is this module's own, no gradient is asked, and the
    kernel takes both sources on q's device (on an H200, glm52_mini's decode step at 256K, G=8: 2.764 ms against
    2.890 with each source apart, docs/BENCHMARKS.md 2026-12-04); else each source through `attention_fn` (a model's
    hook), merged by lse. Inside a compiled graph the one launch is an opaque op
    (`longstraw::sparse_mla_two_sources`)."""
    if attention_fn is not sparse_mla_attention:
        return reference.sparse_mla_two_sources(q_BTHA, latent_PL, rope_PR, new_latent_NL, new_rope_NR, idx_BTK,
                                                slots, scale=scale, attention_fn=attention_fn)
    if torch.compiler.is_compiling():
        return _two_sources_op(q_BTHA, latent_PL, rope_PR, new_latent_NL, new_rope_NR, idx_BTK, slots, scale)
    return _two_sources(q_BTHA, latent_PL, rope_PR, new_latent_NL, new_rope_NR, idx_BTK, slots, scale)


def _two_sources(q_BTHA, latent_PL, rope_PR, new_latent_NL, new_rope_NR, idx_BTK, slots, scale):
    graph_free = not needs_grad(q_BTHA, latent_PL, rope_PR, new_latent_NL, new_rope_NR)
    if graph_free and use_triton(q_BTHA, latent_PL, rope_PR, idx_BTK) and use_triton(q_BTHA, new_latent_NL,
                                                                                        new_rope_NR, idx_BTK):
        reference.check_shapes(q_BTHA, latent_PL, rope_PR, idx_BTK)
        return triton_module().sparse_mla_forward(q_BTHA, latent_PL, rope_PR, idx_BTK, scale,
                                                  new=(new_latent_NL, new_rope_NR, slots))
    return reference.sparse_mla_two_sources(q_BTHA, latent_PL, rope_PR, new_latent_NL, new_rope_NR, idx_BTK, slots,
                                            scale=scale, attention_fn=sparse_mla_attention)


@torch.library.custom_op("longstraw::sparse_mla_two_sources", mutates_args=())
def _two_sources_op(q_BTHA: torch.Tensor, latent_PL: torch.Tensor, rope_PR: torch.Tensor, new_latent_NL: torch.Tensor,
                    new_rope_NR: torch.Tensor, idx_BTK: torch.Tensor, slots: int,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return _two_sources(q_BTHA, latent_PL, rope_PR, new_latent_NL, new_rope_NR, idx_BTK, slots, scale)


@_two_sources_op.register_fake
def _(q_BTHA, latent_PL, rope_PR, new_latent_NL, new_rope_NR, idx_BTK, slots, scale):
    return _fake_forward(q_BTHA, latent_PL, rope_PR, idx_BTK, scale)


def selected_rows(latent_PL, rope_PR, idx_BTK, device):
    """The page rows that `idx_BTK` selects, each once, on `device`, and idx renumbered into them (-1 kept, as it
    is skipped). The attention then reads the same keys in the same order: the same result, bit for bit. The rows
    are gathered where the pages are (into pinned memory when CUDA is there) and copied asynchronously; the set of
    rows is the one host synchronisation. -> (latent_UL, rope_UR, idx_BTK on them)."""
    # sorted and never empty: -1 entries read as row 0 here and stay -1 below
    rows_U = torch.unique(idx_BTK.clamp(min=0))
    host_rows_U = rows_U.to(latent_PL.device)
    pinned = torch.cuda.is_available() and latent_PL.device.type == "cpu"
    moved = []
    for pages_PX in (latent_PL, rope_PR):
        rows_UX = torch.empty((rows_U.numel(), pages_PX.shape[1]), dtype=pages_PX.dtype, device=pages_PX.device,
                              pin_memory=pinned)
        torch.index_select(pages_PX, 0, host_rows_U, out=rows_UX)
        moved.append(rows_UX.to(device, non_blocking=True))
    idx_BTK = torch.searchsorted(rows_U, idx_BTK.clamp(min=0)).masked_fill(idx_BTK < 0, -1)
    return moved[0], moved[1], idx_BTK
