"""Gated DeltaNet: recurrent reference and chunked torch implementation, with initial and final state."""

from longstraw_kernels.gdn.fla_gpu import gdn_forward, gdn_step
from longstraw_kernels.gdn.reference import gdn_chunked, gdn_recurrent

__all__ = ["gdn_chunked", "gdn_forward", "gdn_recurrent", "gdn_step"]
