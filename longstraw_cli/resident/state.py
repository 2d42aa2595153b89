"""The resident state: what a prompt capture keeps, and nothing else.

Capture runs without autograd, so every tensor here is a constant to the replays that read it. Replays never
write into it; only `capture` fills it.

Legend: P pages (captured prompt tokens), K kv heads, D head dim, C conv channels, W conv window (kernel - 1),
G value heads of a recurrent layer, Dk/Dv its key/value head dims.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionPages:
    """K/V of one full-attention layer for the captured prompt tokens."""

    k_PKD: torch.Tensor
    v_PKD: torch.Tensor


@dataclass
class RecurrentState:
    """State of one Gated DeltaNet layer after the captured prompt tokens."""

    # the last W pre-convolution inputs (zeros where the prompt is shorter than the window)
    conv_CW: torch.Tensor
    # recurrent state, always fp32
    ssm_GKV: torch.Tensor


@dataclass
class Resident:
    """Per-layer state of one captured prompt, plus the prompt's last token, which replay starts from."""

    layers: list[AttentionPages | RecurrentState]
    num_tokens: int
    last_token: int

    def nbytes(self) -> dict[str, int]:
        """Bytes by component, as allocated."""
        out = {"kv_pages": 0, "recurrent_state": 0, "conv_state": 0}
        for layer in self.layers:
            if isinstance(layer, AttentionPages):
                out["kv_pages"] += _nbytes(layer.k_PKD) + _nbytes(layer.v_PKD)
            else:
                out["recurrent_state"] += _nbytes(layer.ssm_GKV)
                out["conv_state"] += _nbytes(layer.conv_CW)
        out["total"] = sum(out.values())
        return out

    def tensors(self) -> list[torch.Tensor]:
        out = []
        for layer in self.layers:
            if isinstance(layer, AttentionPages):
                out += [layer.k_PKD, layer.v_PKD]
            else:
                out += [layer.conv_CW, layer.ssm_GKV]
        return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
