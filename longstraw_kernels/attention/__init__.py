"""Replay attention: queries against shared prompt pages (no mask) plus new keys (causal), merged by LSE.

`replay_attention` dispatches: flash attention's forward on CUDA (bf16/fp16), the torch reference otherwise;
`reference.replay_attention` is the reference itself, which every other version is tested against."""

from longstraw_kernels.attention.blockwise import blockwise_causal_attention
from longstraw_kernels.attention.dispatch import replay_attention

__all__ = ["blockwise_causal_attention", "replay_attention"]
