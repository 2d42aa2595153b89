"""Replay attention on CUDA: the forward through aten's flash attention (which returns the LSE), the backward
the reference's ring-style recomputation from the global out and lse (same saved tensors, same contract).

Pages have no mask, so a kv group's query heads and the batch fold into the query axis against the pages
([1, K, B*G*R, D] x [1, K, P, D]): pages are never expanded to the query heads. The new keys are causal, so
they are expanded to the query heads instead; they are one response long. Flash attention's causal mask is
top-left aligned, which is the bottom-right alignment replay needs only when R == S (or R == 1, where no mask
is needed): other shapes take the reference.

Legend: B batch, R queries, S new keys, P pages, Q query heads, K kv heads, G = Q // K, D head dim.
"""

import torch

from longstraw_kernels.attention.reference import _ReplayAttention

FLASH_DTYPES = (torch.bfloat16, torch.float16)


def flash_supported(q_BRQD, k_pages_PKD, k_new_BSKD) -> bool:
    R, D, S = q_BRQD.shape[1], q_BRQD.shape[3], k_new_BSKD.shape[1]
    return (q_BRQD.is_cuda and q_BRQD.dtype in FLASH_DTYPES and k_pages_PKD.dtype == q_BRQD.dtype
            and k_new_BSKD.dtype == q_BRQD.dtype and D <= 256 and D % 8 == 0 and (S in (0, R) or R == 1))


def _flash(q_BHLD, k_BHMD, v_BHMD, causal: bool, scale: float):
    out = torch.ops.aten._scaled_dot_product_flash_attention(q_BHLD, k_BHMD, v_BHMD, 0.0, causal, False,
                                                             scale=scale)
    return out[0], out[1]


class _FlashReplayAttention(_ReplayAttention):
    @staticmethod
    def forward(ctx, q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD, scale, block_size):
        B, R, Q, D = q_BRQD.shape
        P, K = k_pages_PKD.shape[:2]
        S, G = k_new_BSKD.shape[1], Q // K
        outs, lses = [], []
        if S > 0:
            q_BQRD = q_BRQD.transpose(1, 2)
            k_BQSD = k_new_BSKD.transpose(1, 2).repeat_interleave(G, dim=1)
            v_BQSD = v_new_BSKD.transpose(1, 2).repeat_interleave(G, dim=1)
            out_BQRD, lse_BQR = _flash(q_BQRD, k_BQSD, v_BQSD, R > 1, scale)
            outs.append(out_BQRD.float())
            lses.append(lse_BQR)
        if P > 0:
            # [B, R, K, G, D] -> [1, K, B*G*R, D]: batch and group heads become query rows
            q_1KMD = q_BRQD.reshape(B, R, K, G, D).permute(2, 0, 3, 1, 4).reshape(1, K, B * G * R, D)
            out_1KMD, lse_1KM = _flash(q_1KMD, k_pages_PKD.transpose(0, 1)[None], v_pages_PKD.transpose(0, 1)[None],
                                       False, scale)
            outs.append(out_1KMD.float().reshape(K, B, G, R, D).permute(1, 0, 2, 3, 4).reshape(B, Q, R, D))
            lses.append(lse_1KM.reshape(K, B, G, R).permute(1, 0, 2, 3).reshape(B, Q, R))
        lse_BQR = lses[0] if len(lses) == 1 else torch.logaddexp(lses[0], lses[1])
        out_BQRD = sum(torch.exp(l - lse_BQR)[..., None] * o for o, l in zip(outs, lses))
        out_BRQD = out_BQRD.transpose(1, 2).to(q_BRQD.dtype).contiguous()
        ctx.save_for_backward(q_BRQD, k_pages_PKD, v_pages_PKD, k_new_BSKD, v_new_BSKD, out_BRQD, lse_BQR)
        ctx.scale, ctx.block_size = scale, block_size
        ctx.set_materialize_grads(False)
        return out_BRQD, lse_BQR
