"""Replay attention: queries against shared prompt pages (no mask) plus new keys (causal), merged by LSE."""

from longstraw_kernels.attention.blockwise import blockwise_causal_attention
from longstraw_kernels.attention.reference import replay_attention

__all__ = ["blockwise_causal_attention", "replay_attention"]
