"""Gated DeltaNet: recurrent reference and chunked torch implementation, with initial and final state."""

from longstraw_kernels.gdn.fla_gpu import conv_silu, conv_step, gdn_decode, gdn_forward
from longstraw_kernels.gdn.reference import gdn_chunked, gdn_recurrent

__all__ = ["conv_silu", "conv_step", "gdn_chunked", "gdn_decode", "gdn_forward", "gdn_recurrent"]
