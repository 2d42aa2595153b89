"""Replay attention: queries against shared prompt pages (no mask) plus new keys (causal), merged by LSE."""

from longstraw_kernels.attention.reference import replay_attention

__all__ = ["replay_attention"]
