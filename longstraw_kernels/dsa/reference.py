"""DSA lightning-indexer scores in plain torch: the reference the Triton kernel is tested against, and the path
on CPU and for dtypes the kernel does not take.

    score[b, t, s] = sum_j w[b, t, j] * relu(scale * q[b, t, j, :] . k[s, :])        (-inf where s > t + offset)

It forms [B, T, J, chunk] intermediates in the compute dtype, `_SCORE_ELEMENTS` at a time along the keys: it is
memory-bound, which is what the kernel removes.

Legend: B batch, T queries, J index heads, I index head dim, S keys.
"""

from __future__ import annotations

import torch

from longstraw_kernels import compute_dtype

# bound on the [B, T, J, keys] intermediate formed at once
_SCORE_ELEMENTS = 1 << 24


def indexer_scores_reference(q_BTJI: torch.Tensor, w_BTJ: torch.Tensor, k: torch.Tensor, scale: float,
                             offset: int | None = None) -> torch.Tensor:
    """Index scores [B, T, S] in `compute_dtype(q)` of the queries against one key group: `k` is [S, I] (shared
    by the batch, prompt pages) or [B, S, I] (per sequence). With `offset`, query t sees key s iff
    s <= t + offset; the others are -inf."""
    B, T, J, _ = q_BTJI.shape
    dtype = compute_dtype(q_BTJI)
    q_BTJI, w_BTJ, k = q_BTJI.to(dtype), w_BTJ.to(dtype), k.to(dtype)
    shared = k.dim() == 2
    S = k.shape[-2]
    step = max(1, _SCORE_ELEMENTS // max(1, B * T * J))
    t_T1 = torch.arange(T, device=q_BTJI.device)[:, None]
    out = []
    for s0 in range(0, S, step):
        k_chunk = k[..., s0 : s0 + step, :]
        dots_BTJS = torch.einsum("btji,si->btjs" if shared else "btji,bsi->btjs", q_BTJI, k_chunk)
        scores_BTS = torch.einsum("btj,btjs->bts", w_BTJ, torch.relu(dots_BTJS * scale))
        if offset is not None:
            s_1S = torch.arange(s0, s0 + k_chunk.shape[-2], device=q_BTJI.device)[None, :]
            scores_BTS = scores_BTS.masked_fill(s_1S > t_T1 + offset, float("-inf"))
        out.append(scores_BTS)
    if len(out) == 1:
        return out[0]
    return torch.cat(out, dim=-1) if out else q_BTJI.new_empty(B, T, 0)
