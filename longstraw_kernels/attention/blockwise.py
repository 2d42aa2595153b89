"""Causal attention over a whole span, one query block at a time, built on replay_attention.

Block b's queries see the span's keys before the block as pages (no mask) and the block's own keys causally, so
no [T, T] score matrix is ever formed: scores are bounded by block_size x block_size (pages are themselves
processed in blocks by replay_attention). Used by the layer-by-layer prompt capture.

Legend: B batch (1 here), T span tokens, Q query heads, K kv heads, D head dim.
"""

import torch

from longstraw_kernels.attention.dispatch import replay_attention


def blockwise_causal_attention(q_BTQD, k_TKD, v_TKD, *, scale, block_size=4096, attention_fn=replay_attention):
    """-> out_BTQD: causal attention of the span over itself (the span's keys are shared by the batch)."""
    pieces = []
    for start in range(0, q_BTQD.shape[1], block_size):
        end = min(start + block_size, q_BTQD.shape[1])
        pieces.append(attention_fn(q_BTQD[:, start:end], k_TKD[:start], v_TKD[:start],
                                   k_TKD[start:end][None], v_TKD[start:end][None], scale=scale,
                                   block_size=block_size))
    return torch.cat(pieces, dim=1) if pieces else q_BTQD.new_zeros(q_BTQD.shape)
