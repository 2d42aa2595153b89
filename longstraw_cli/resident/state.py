"""The resident state: what a prompt capture keeps, and nothing else.

Capture runs without autograd, so every tensor here is a constant to the replays that read it. Replays never
write into it; only `capture` fills it.

Exact mode (`capture.gradient=exact`, resident/gradient.py) differentiates through it: each kind of layer state
names its differentiable fields (`GRAD_FIELDS`) and whether a prompt block reads it as the PAGES of the positions
before the block (paged: attention K/V, MLA latent and rope keys) or as the state CARRIED from the block before
(recurrent: GDN conv and recurrent state). DSA indexer keys only select (top-k), so they carry no gradient.

Legend: P pages (captured prompt tokens), K kv heads, D head dim, C conv channels, W conv window (kernel - 1),
G value heads of a recurrent layer, Dk/Dv its key/value head dims, L MLA latent dim (kv_lora_rank), R rope dim,
I indexer head dim.

Offload: with `offload="cpu"` the PAGED states (attention K/V, MLA latent, rope and indexer keys) live in CPU
memory (pinned when CUDA is available) and compute stages them onto its device one layer at a time
(`resident.offload`); CARRIED states (GDN conv + recurrent state: a few MB a layer, whatever the prompt's
length) stay on the device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


class Paged:
    """What a paged layer state (its fields are per-token pages, or None) offers offload (resident/offload.py)."""

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (getattr(self, f.name) for f in dataclasses.fields(self)) if t is not None]

    def empty_on(self, device, num: int | None = None):
        """Uninitialised pages of the same shapes (of the first `num` positions, if given) on `device`."""
        return self._map(lambda name, t: torch.empty((t.shape[0] if num is None else num, *t.shape[1:]),
                                                     dtype=t.dtype, device=device))

    def to(self, device, non_blocking: bool = False, index_only: bool = False):
        """A copy on `device` (always a copy, also on the same device). index_only: copy only the fields in
        `INDEX_FIELDS` (glm52's indexer keys, which every query scores in full) and keep referring to the other
        pages (a replay under autograd reads those where they are: gathering selected rows, or block by block)."""
        def move(name, t):
            if index_only and name not in self.INDEX_FIELDS:
                return t
            out = torch.empty(t.shape, dtype=t.dtype, device=device)
            return out.copy_(t, non_blocking=non_blocking)
        return self._map(move)

    def _map(self, fn):
        """The same state with fn(name, field) for every field that is not None."""
        return dataclasses.replace(self, **{f.name: None if getattr(self, f.name) is None
                                            else fn(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)})


@dataclass
class AttentionPages(Paged):
    """K/V of one full-attention layer for the captured prompt tokens."""

    k_PKD: torch.Tensor
    v_PKD: torch.Tensor

    GRAD_FIELDS = ("k_PKD", "v_PKD")
    INDEX_FIELDS = ()
    CARRIED = False


@dataclass
class RecurrentState:
    """State of one Gated DeltaNet layer after the captured prompt tokens."""

    # the last W pre-convolution inputs (zeros where the prompt is shorter than the window)
    conv_CW: torch.Tensor
    # recurrent state, always fp32
    ssm_GKV: torch.Tensor

    GRAD_FIELDS = ("conv_CW", "ssm_GKV")
    CARRIED = True

    def tensors(self) -> list[torch.Tensor]:
        return [self.conv_CW, self.ssm_GKV]


@dataclass
class MLAPages(Paged):
    """One glm52 layer: MLA latent (after kv_a_layernorm) and rope key (after RoPE) per captured token, plus the
    DSA indexer keys (after LayerNorm + RoPE) on "full" indexer layers; "shared" layers keep none (None).
    Never expanded per head: kv_b is folded into the query and the output at replay."""

    latent_PL: torch.Tensor
    rope_PR: torch.Tensor
    index_PI: torch.Tensor | None

    GRAD_FIELDS = ("latent_PL", "rope_PR")
    INDEX_FIELDS = ("index_PI",)
    CARRIED = False


# nbytes() keys of the CARRIED kinds: what stays on the device when the pages are offloaded
CARRIED_COMPONENTS = ("recurrent_state", "conv_state")
# nbytes() keys per kind of layer state, in report order
_COMPONENTS = {
    AttentionPages: ("kv_pages",),
    RecurrentState: ("recurrent_state", "conv_state"),
    MLAPages: ("latent_pages", "rope_pages", "index_pages"),
}


@dataclass
class Resident:
    """Per-layer state of one captured prompt, plus the prompt's last token, which replay starts from."""

    layers: list[AttentionPages | RecurrentState | MLAPages]
    num_tokens: int
    last_token: int
    # None: pages on the compute device; "cpu": in (pinned) CPU memory, staged one layer at a time
    offload: str | None = None
    # exact mode: per capture block, the CARRIED layer states at the block's start (None for paged layers);
    # the reverse walk recomputes each block from them (models/core.py `prompt_backward`). Under context parallel
    # a rank keeps those of the blocks that start in its shard; the others' entries are None (cp_walk.py)
    boundaries: list[list | None] | None = None
    # capture.reuse_steps > 1: the CARRIED layer states at the last capture block's start, position tail_start
    # (reuse.py's drift probe; the capture cut that block to capture.probe_tokens)
    tail: list | None = None
    tail_start: int | None = None

    def nbytes(self) -> dict[str, int]:
        """Bytes by component, as allocated (the components of the layer kinds present, then "total")."""
        kinds = [k for k in _COMPONENTS if any(isinstance(layer, k) for layer in self.layers)] or [AttentionPages,
                                                                                                  RecurrentState]
        out = {name: 0 for kind in kinds for name in _COMPONENTS[kind]}
        for layer in self.layers:
            if isinstance(layer, AttentionPages):
                out["kv_pages"] += _nbytes(layer.k_PKD) + _nbytes(layer.v_PKD)
            elif isinstance(layer, RecurrentState):
                out["recurrent_state"] += _nbytes(layer.ssm_GKV)
                out["conv_state"] += _nbytes(layer.conv_CW)
            else:
                out["latent_pages"] += _nbytes(layer.latent_PL)
                out["rope_pages"] += _nbytes(layer.rope_PR)
                out["index_pages"] += 0 if layer.index_PI is None else _nbytes(layer.index_PI)
        if self.boundaries is not None:
            out["boundary_states"] = sum(_nbytes(t) for t in self.boundary_tensors())
        if self.tail is not None:
            out["tail_states"] = sum(_nbytes(t) for t in carried_tensors(self.tail))
        out["total"] = sum(out.values())
        return out

    def boundary_tensors(self) -> list[torch.Tensor]:
        return [t for block in self.boundaries or [] if block is not None for t in carried_tensors(block)]

    def tensors(self) -> list[torch.Tensor]:
        out = []
        for layer in self.layers:
            if isinstance(layer, AttentionPages):
                out += [layer.k_PKD, layer.v_PKD]
            elif isinstance(layer, RecurrentState):
                out += [layer.conv_CW, layer.ssm_GKV]
            else:
                out += layer.tensors()
        return out + self.boundary_tensors() + carried_tensors(self.tail or [])


def carried_tensors(states: list) -> list[torch.Tensor]:
    """The tensors of a snapshot's carried states (its None entries, paged layers, have none)."""
    return [getattr(s, f.name) for s in states if s is not None for f in dataclasses.fields(s)]


def prefix(state, num: int):
    """A paged layer state's first `num` positions (views; None fields stay None)."""
    def head(t):
        return None if t is None else t[:num]
    return dataclasses.replace(state, **{f.name: head(getattr(state, f.name)) for f in dataclasses.fields(state)})


def snapshot(resident: Resident) -> list:
    """Copies of the resident's CARRIED layer states (None for paged layers): a capture block boundary."""
    return [dataclasses.replace(s, **{f.name: getattr(s, f.name).clone() for f in dataclasses.fields(s)})
            if s.CARRIED else None for s in resident.layers]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
