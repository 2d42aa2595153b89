"""qwen36 = HF `qwen3_5_text` (Qwen3.5/3.6 hybrid) in plain PyTorch, single device.

The walks through the layers (`forward`, `capture`, `capture_span`, `logprobs`, `decode_step`) are the shared
`models.core.CausalLM`'s; each layer here has one method per named path (see core.py):
- `forward`: the full-sequence reference (causal SDPA, chunked GDN from a zero state).
- `capture_block`: one prompt block under no_grad; attention writes its K/V pages, GDN advances its conv +
  recurrent state, both in place. No logits are formed for prompt tokens.
- `capture_span`: one layer over a whole span (context parallel swaps the span hooks).
- `replay`: tokens after the prompt against the resident state, which is read, never written.
- `replay_block`: one block of a response against the resident state and the response's earlier blocks (their
  K/V, or the GDN state at the block's start): blockwise replay and scoring (models/blockwise.py).
- `decode_step`: one token per response against the prompt plus the response's own cache.
Module names mirror HF's so a checkpoint's state dict loads as it is.

Legend: B batch, T tokens, C hidden, Q query heads, K kv heads, D head dim, H GDN key heads, G GDN value heads,
Dk/Dv GDN head dims, X conv channels, W conv window (kernel - 1), P pages, V vocab.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from longstraw_cli.models import core
from longstraw_cli.models.core import MLP, Backbone, CausalLM, DecodeState, stop_grad_prefix
from longstraw_cli.models.qwen36.config import Qwen36Config
from longstraw_cli.models.qwen36.decode import Qwen36Decoder, ResponseKV
from longstraw_cli.models.qwen36.rope import apply_partial_rope, rope_cos_sin
from longstraw_cli.resident import AttentionPages, RecurrentState, Resident
from longstraw_cli.resident.offload import OFFLOAD_CHOICES, host_buffer
from longstraw_cli.resident.state import prefix
from longstraw_kernels import compute_dtype
from longstraw_kernels.attention import blockwise_causal_attention, replay_attention
from longstraw_kernels.attention.decode import decode_pages_attention
from longstraw_kernels.gdn import conv_silu, gdn_forward
from longstraw_kernels.gdn.reference import conv_window_after, gdn_decay
from longstraw_kernels.norm import gated_norm, l2norm_fp32, rms_norm, silu_mul


class RMSNorm(nn.Module):
    """fp32 RMSNorm scaled by (1 + w), w initialised to zero."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # linear/reference.py's `rms_norm_one_plus` (the decode linear kernel's prologue computes the same), one
        # launch forward and one backward on CUDA (longstraw_kernels/norm)
        return rms_norm(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """GDN output norm: plain w (init ones), then times silu(z)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_norm(x, z, self.weight, self.eps)


class GatedAttention(nn.Module):
    """Full attention with q/k RMSNorm, partial RoPE, GQA and a per-head sigmoid output gate."""

    def __init__(self, cfg: Qwen36Config):
        super().__init__()
        self.cfg = cfg
        self.num_q, self.num_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_q * self.head_dim * 2, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_q * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        # swapped from outside (GPU kernels, context parallel); the model only calls them.
        # attention_fn: replay, scoring, decode and block-by-block capture; span_attention_fn: a whole span's
        # causal self-attention in the layer-by-layer capture (context parallel swaps in its ring version)
        self.attention_fn = replay_attention
        self.span_attention_fn = blockwise_causal_attention
        # decode: one query token per response against the shared pages -> (out, lse); context parallel swaps
        # in its cross-rank merge
        self.decode_pages_fn = decode_pages_attention

    def project(self, x_BTC: torch.Tensor, positions_T: torch.Tensor):
        return self.project_from(self.q_proj(x_BTC), self.k_proj(x_BTC), self.v_proj(x_BTC), positions_T)

    def project_from(self, q_BTX, k_BTX, v_BTX, positions_T: torch.Tensor):
        """`project` from its three linears' outputs (the decode step computes them as one GEMM)."""
        q_BTQD, gate_BTQD = self.split_query_gate(q_BTX)
        B, T = q_BTQD.shape[:2]
        q_BTQD = self.q_norm(q_BTQD)
        k_BTKD = self.k_norm(k_BTX.view(B, T, self.num_kv, self.head_dim))
        v_BTKD = v_BTX.view(B, T, self.num_kv, self.head_dim)
        cos, sin = rope_cos_sin(positions_T, self.cfg.rotary_dim, self.cfg.rope_theta, q_BTQD.dtype)
        return apply_partial_rope(q_BTQD, cos, sin), apply_partial_rope(k_BTKD, cos, sin), v_BTKD, gate_BTQD

    def split_query_gate(self, q_BTX: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q_proj's output [B, T, Q * 2 D] (each head's query, then its gate) -> (queries, gates) [B, T, Q, D]."""
        B, T, _ = q_BTX.shape
        q_BTQD, gate_BTQD = q_BTX.view(B, T, self.num_q, 2 * self.head_dim).chunk(2, dim=-1)
        return q_BTQD, gate_BTQD

    def output(self, o_BTQD: torch.Tensor, gate_BTQD: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.gated(o_BTQD, gate_BTQD))

    def gated(self, o_BTQD: torch.Tensor, gate_BTQD: torch.Tensor) -> torch.Tensor:
        """The heads' outputs times their sigmoid gates, heads joined: o_proj's input [B, T, Q * D]."""
        B, T = o_BTQD.shape[:2]
        return (o_BTQD * torch.sigmoid(gate_BTQD)).reshape(B, T, -1)

    def forward(self, x_BTC, positions_T, grad_prefix: int = 0):
        """Full causal attention over x (keys and values of positions < grad_prefix carry no gradient)."""
        q_BTQD, k_BTKD, v_BTKD, gate_BTQD = self.project(x_BTC, positions_T)
        k_BTKD, v_BTKD = stop_grad_prefix(k_BTKD, grad_prefix), stop_grad_prefix(v_BTKD, grad_prefix)
        o_BQTD = F.scaled_dot_product_attention(
            q_BTQD.transpose(1, 2), k_BTKD.transpose(1, 2), v_BTKD.transpose(1, 2),
            is_causal=True, scale=self.scale, enable_gqa=True,
        )
        return self.output(o_BQTD.transpose(1, 2), gate_BTQD)

    def capture_block(self, x_BTC, positions_T, pages: AttentionPages, start: int):
        """x's keys become pages start.., then x attends to the pages before them plus its own keys (causal)."""
        y_BTC, written = self.recompute_block(x_BTC, positions_T, prefix(pages, start))
        end = start + x_BTC.shape[1]
        pages.k_PKD[start:end].copy_(written.k_PKD)
        pages.v_PKD[start:end].copy_(written.v_PKD)
        return y_BTC

    def recompute_block(self, x_BTC, positions_T, before: AttentionPages):
        """capture_block's function: x attends to the pages `before` it plus its own keys (causal), its keys
        rounded to the page dtype first, as replay will read them. -> (y_BTC, x's pages)."""
        q_BTQD, k_BTKD, v_BTKD, gate_BTQD = self.project(x_BTC, positions_T)
        k_BTKD, v_BTKD = k_BTKD.to(before.k_PKD.dtype), v_BTKD.to(before.v_PKD.dtype)
        o_BTQD = self.attention_fn(q_BTQD, before.k_PKD, before.v_PKD, k_BTKD, v_BTKD, scale=self.scale)
        return self.output(o_BTQD, gate_BTQD), AttentionPages(k_BTKD[0], v_BTKD[0])

    def replay(self, x_BTC, positions_T, pages: AttentionPages):
        """x continues the pages: it attends to every page plus its own keys (causal)."""
        q_BTQD, k_BTKD, v_BTKD, gate_BTQD = self.project(x_BTC, positions_T)
        o_BTQD = self.attention_fn(q_BTQD, pages.k_PKD, pages.v_PKD, k_BTKD, v_BTKD, scale=self.scale)
        return self.output(o_BTQD, gate_BTQD)

    def replay_block(self, x_BTC, positions_T, pages: AttentionPages, before: AttentionPages | None):
        """One block of the response: x attends to every page plus the response's keys `before` it (batched
        [B, S, K, D], None for the first block) and its own (causal). -> (y_BTC, x's keys and values, batched)."""
        q_BTQD, k_BTKD, v_BTKD, gate_BTQD = self.project(x_BTC, positions_T)
        k_BSKD, v_BSKD = k_BTKD, v_BTKD
        if before is not None:
            k_BSKD, v_BSKD = torch.cat([before.k_PKD, k_BTKD], dim=1), torch.cat([before.v_PKD, v_BTKD], dim=1)
        o_BTQD = self.attention_fn(q_BTQD, pages.k_PKD, pages.v_PKD, k_BSKD, v_BSKD, scale=self.scale)
        return self.output(o_BTQD, gate_BTQD), AttentionPages(k_BTKD, v_BTKD)

    def decode_step(self, x_BTC, positions_T, pages: AttentionPages, cache: ResponseKV):
        """x's keys are appended to the per-sequence response keys; x attends to the pages plus all of those."""
        q_BTQD, k_BTKD, v_BTKD, gate_BTQD = self.project(x_BTC, positions_T)
        k_BSKD, v_BSKD = cache.append(k_BTKD, v_BTKD)
        o_BTQD = self.attention_fn(q_BTQD, pages.k_PKD, pages.v_PKD, k_BSKD, v_BSKD, scale=self.scale)
        return self.output(o_BTQD, gate_BTQD)

    def capture_span(self, x_BTC, positions_T, pages: AttentionPages, block_size: int):
        """Layer-by-layer capture: the whole span's keys become the pages, then causal attention over them."""
        q_BTQD, k_BTKD, v_BTKD, gate_BTQD = self.project(x_BTC, positions_T)
        pages.k_PKD.copy_(k_BTKD[0])
        pages.v_PKD.copy_(v_BTKD[0])
        o_BTQD = self.span_attention_fn(q_BTQD, pages.k_PKD, pages.v_PKD, scale=self.scale, block_size=block_size)
        return self.output(o_BTQD, gate_BTQD)


def local_conv_window(mixed_BTX: torch.Tensor, window_BXW: torch.Tensor):
    """(window before the span, window after it): the conv inputs that precede and end the span."""
    return window_BXW, conv_window_after(window_BXW, mixed_BTX)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet (Qwen3.5 layout): separate in_proj_qkv / z / b / a, depthwise causal conv + SiLU."""

    def __init__(self, cfg: Qwen36Config):
        super().__init__()
        self.cfg = cfg
        self.num_k, self.num_v = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.num_k * self.dk, self.num_v * self.dv
        self.conv_dim = cfg.conv_dim
        self.window = cfg.linear_conv_kernel_dim - 1
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, self.num_v, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, self.num_v, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, cfg.linear_conv_kernel_dim, groups=self.conv_dim,
                                bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v))
        self.A_log = nn.Parameter(torch.empty(self.num_v).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, cfg.hidden_size, bias=False)
        # swapped from outside (GPU kernels, context parallel); the model only calls them.
        # gdn_fn: replay, scoring, decode, block-by-block capture; span_gdn_fn and window_fn: the layer-by-layer
        # capture of a span, whose state context parallel composes across ranks
        self.gdn_fn = gdn_forward
        self.span_gdn_fn = gdn_forward
        self.window_fn = local_conv_window

    # positions_T: unused (no RoPE in GDN); every token mixer of a layer takes the same arguments per path
    def forward(self, x_BTC, positions_T, grad_prefix: int = 0):
        """Full sequence from a zero state (inputs of positions < grad_prefix carry no gradient)."""
        mixed_BTX = stop_grad_prefix(self.in_proj_qkv(x_BTC), grad_prefix)
        window_BXW = mixed_BTX.new_zeros(x_BTC.shape[0], self.conv_dim, self.window)
        return self.mix(x_BTC, mixed_BTX, window_BXW, None, self.gdn_fn, grad_prefix)[0]

    def capture_block(self, x_BTC, positions_T, state: RecurrentState, start: int):
        """One prompt block from `state`, which it advances in place to the block's end."""
        y_BTC, written = self.recompute_block(x_BTC, positions_T, state)
        state.conv_CW.copy_(written.conv_CW)
        state.ssm_GKV.copy_(written.ssm_GKV)
        return y_BTC

    def recompute_block(self, x_BTC, positions_T, state: RecurrentState):
        """capture_block's function: one prompt block from `state`. -> (y_BTC, the state at the block's end)."""
        y_BTC, conv_BXW, ssm_BGKV = self.mix(x_BTC, *self.read(state, x_BTC), self.gdn_fn)
        return y_BTC, RecurrentState(conv_BXW[0], ssm_BGKV[0])

    def replay(self, x_BTC, positions_T, state: RecurrentState):
        """Tokens after the prompt, from the prompt's state, which is read, never written."""
        return self.mix(x_BTC, *self.read(state, x_BTC), self.gdn_fn)[0]

    def replay_block(self, x_BTC, positions_T, state: RecurrentState, before: RecurrentState):
        """One block of the response from the state at its start `before` (batched; the prompt's for the first
        block), not `state`. -> (y_BTC, the state at the block's end, batched)."""
        y_BTC, conv_BXW, ssm_BGKV = self.mix(x_BTC, *self.read(before, x_BTC), self.gdn_fn)
        # the window is its own tensor (conv_silu), not a view of the block's conv input that each block's start
        # state would keep alive (5.3 MB a layer at the 27B shape, blocks of 256)
        return y_BTC, RecurrentState(conv_BXW, ssm_BGKV)

    def decode_step(self, x_BTC, positions_T, state: RecurrentState, cache: RecurrentState):
        """One token per sequence from its own (batched) state `cache`, which then holds the state after it."""
        y_BTC, cache.conv_CW, cache.ssm_GKV = self.mix(x_BTC, *self.read(cache, x_BTC), self.gdn_fn)
        return y_BTC

    def read(self, state: RecurrentState, x_BTC):
        """-> (mixed_BTX, window_BXW, ssm_BGKV): x's conv inputs, and `state` broadcast over x's batch."""
        B = x_BTC.shape[0]
        mixed_BTX = self.in_proj_qkv(x_BTC)
        return mixed_BTX, state.conv_CW.to(mixed_BTX.dtype).expand(B, -1, -1), state.ssm_GKV.expand(B, -1, -1, -1)

    def capture_span(self, x_BTC, positions_T, state: RecurrentState, block_size: int):
        """Layer-by-layer capture of a span: output, and `state` advanced in place to the end of the span."""
        mixed_BTX = self.in_proj_qkv(x_BTC)
        window_in_BXW, window_out_BXW = self.window_fn(mixed_BTX, state.conv_CW.to(mixed_BTX.dtype)[None])
        # window_fn's window, not mix's: under context parallel the span's end is not the prompt's end
        y_BTC, _, ssm_BGKV = self.mix(x_BTC, mixed_BTX, window_in_BXW, state.ssm_GKV[None], self.span_gdn_fn)
        state.conv_CW.copy_(window_out_BXW[0])
        state.ssm_GKV.copy_(ssm_BGKV[0])
        return y_BTC

    def mix(self, x_BTC, mixed_BTX, window_BXW, ssm_BGKV, gdn_fn, grad_prefix: int = 0):
        """Conv over (window, mixed), gates, the gated delta rule from ssm, gated norm, out_proj.
        -> (y_BTC, the conv window after mixed (its own tensor), ssm_BGKV after mixed)."""
        return self.mix_projected(mixed_BTX, self.in_proj_z(x_BTC), self.in_proj_b(x_BTC), self.in_proj_a(x_BTC),
                                  window_BXW, ssm_BGKV, gdn_fn, grad_prefix)

    def mix_projected(self, mixed_BTX, z_BTX, b_BTG, a_BTG, window_BXW, ssm_BGKV, gdn_fn, grad_prefix: int = 0):
        """`mix` from its input linears' outputs."""
        q_BTHK, k_BTHK, v_BTGV, window_after_BXW = self.convolve(mixed_BTX, window_BXW)
        q_BTHK = l2norm_fp32(q_BTHK)
        k_BTHK = stop_grad_prefix(l2norm_fp32(k_BTHK), grad_prefix)
        v_BTGV = stop_grad_prefix(v_BTGV, grad_prefix)
        beta_BTG = stop_grad_prefix(b_BTG.sigmoid(), grad_prefix)
        g_BTG = stop_grad_prefix(gdn_decay(a_BTG, self.A_log, self.dt_bias), grad_prefix)
        o_BTGV, new_ssm_BGKV = gdn_fn(q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, ssm_BGKV)
        return self.gated_output(o_BTGV, z_BTX), window_after_BXW, new_ssm_BGKV

    def convolve(self, mixed_BTX, window_BXW):
        """The causal depthwise conv over (window, mixed) and its SiLU, split into heads.
        -> (q_BTHK and k_BTHK before their norms, v_BTGV, the conv window after mixed)."""
        conv_BTX, window_after_BXW = conv_silu(mixed_BTX, window_BXW, self.conv1d.weight)
        return (*self.split_heads(conv_BTX), window_after_BXW)

    def split_heads(self, conv_BTX):
        """The conv's output [B, T, X] -> (q_BTHK, k_BTHK, v_BTGV), views."""
        B, T, _ = conv_BTX.shape
        q, k, v = torch.split(conv_BTX, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(B, T, self.num_k, self.dk), k.reshape(B, T, self.num_k, self.dk),
                v.reshape(B, T, self.num_v, self.dv))

    def gated_output(self, o_BTGV, z_BTX):
        """The gated norm of the delta rule's output by z, then out_proj."""
        return self.out_proj(self.gated(o_BTGV, z_BTX))

    def gated(self, o_BTGV, z_BTX):
        """The gated norm of the delta rule's output by z, heads joined: out_proj's input [B, T, G * Dv]."""
        B, T, _ = z_BTX.shape
        z_BTGV = z_BTX.reshape(B, T, self.num_v, self.dv)
        return self.norm(o_BTGV, z_BTGV).reshape(B, T, self.value_dim)


class DecoderLayer(core.DecoderLayer):
    """One named path per method (see models/core.py); `carry` is unused here (None in, None out)."""

    def __init__(self, cfg: Qwen36Config, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, silu_mul=silu_mul)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def is_attention(self) -> bool:
        return self.layer_type == "full_attention"

    @property
    def mixer(self) -> GatedAttention | GatedDeltaNet:
        return self.self_attn if self.is_attention else self.linear_attn

    def forward(self, x_BTC, positions_T, carry=None, grad_prefix: int = 0):
        h = self.mixer(self.input_layernorm(x_BTC), positions_T, grad_prefix)
        return self.mlp_residual(x_BTC, h), None

    def capture_block(self, x_BTC, positions_T, state, start: int, carry=None):
        h = self.mixer.capture_block(self.input_layernorm(x_BTC), positions_T, state, start)
        return self.mlp_residual(x_BTC, h), None

    def recompute_block(self, x_BTC, positions_T, state, carry=None):
        h, written = self.mixer.recompute_block(self.input_layernorm(x_BTC), positions_T, state)
        return self.mlp_residual(x_BTC, h), None, written

    def capture_span(self, x_BTC, positions_T, state, block_size: int, carry=None):
        h = self.mixer.capture_span(self.input_layernorm(x_BTC), positions_T, state, block_size)
        return self.mlp_residual_blocks(x_BTC, h, block_size), None

    def replay(self, x_BTC, positions_T, state, carry=None):
        return self.mlp_residual(x_BTC, self.mixer.replay(self.input_layernorm(x_BTC), positions_T, state)), None

    def replay_block(self, x_BTC, positions_T, state, before, carry=None):
        h, written = self.mixer.replay_block(self.input_layernorm(x_BTC), positions_T, state, before)
        return self.mlp_residual(x_BTC, h), None, written

    def decode_step(self, x_BTC, positions_T, state, cache, carry=None):
        h = self.mixer.decode_step(self.input_layernorm(x_BTC), positions_T, state, cache)
        return self.mlp_residual(x_BTC, h), None


class Qwen36ForCausalLM(CausalLM):
    family = "qwen36"

    def __init__(self, cfg: Qwen36Config):
        layers = (DecoderLayer(cfg, t) for t in cfg.layer_types)
        super().__init__(cfg, Backbone(cfg.vocab_size, cfg.hidden_size, layers, RMSNorm, cfg.rms_norm_eps))

    def init_module(self, module: nn.Module, std: float) -> None:
        """(1+w) norms at zero; gated norm, dt_bias at one; A_log and the conv as at construction."""
        if isinstance(module, RMSNorm):
            module.weight.zero_()
        elif isinstance(module, GatedRMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, GatedDeltaNet):
            module.dt_bias.fill_(1.0)
            module.A_log.copy_(torch.empty_like(module.A_log).uniform_(0.01, 16).log())
            nn.init.kaiming_uniform_(module.conv1d.weight, a=math.sqrt(5))

    # -- resident state ---------------------------------------------------------------------------------------
    def empty_resident(self, num_tokens: int, page_dtype: torch.dtype | None = None,
                       offload: str | None = None) -> Resident:
        """Preallocated state for `num_tokens` captured tokens, on the device; offload="cpu" puts the attention
        layers' K/V pages in (pinned) CPU memory. The GDN conv + recurrent states stay on the device either way:
        they are a few MB a layer whatever the prompt's length, and every token reads and writes them."""
        if offload not in OFFLOAD_CHOICES:
            raise ValueError(f"offload={offload!r}; valid: {list(OFFLOAD_CHOICES)}")
        cfg, w = self.config, self.lm_head.weight
        page_dtype = page_dtype or w.dtype

        def pages(*shape):
            if offload == "cpu":
                return host_buffer(shape, page_dtype)
            return torch.zeros(shape, dtype=page_dtype, device=w.device)

        layers = []
        for layer in self.model.layers:
            if layer.is_attention:
                shape = (num_tokens, cfg.num_key_value_heads, cfg.head_dim)
                layers.append(AttentionPages(pages(*shape), pages(*shape)))
            else:
                gdn = layer.linear_attn
                conv = torch.zeros(gdn.conv_dim, gdn.window, dtype=w.dtype, device=w.device)
                # fp32 recurrent state (fp64 in fp64 models)
                ssm = torch.zeros(gdn.num_v, gdn.dk, gdn.dv, dtype=compute_dtype(w), device=w.device)
                layers.append(RecurrentState(conv, ssm))
        return Resident(layers=layers, num_tokens=num_tokens, last_token=-1, offload=offload)

    def resident_bytes(self, num_tokens: int, page_dtype: torch.dtype | None = None) -> dict[str, int]:
        """Analytic size of the resident state: what `Resident.nbytes()` must report."""
        cfg = self.config
        page_size = (page_dtype or self.lm_head.weight.dtype).itemsize
        num_attn = sum(t == "full_attention" for t in cfg.layer_types)
        num_gdn = cfg.num_hidden_layers - num_attn
        out = {
            "kv_pages": num_attn * 2 * num_tokens * cfg.num_key_value_heads * cfg.head_dim * page_size,
            "recurrent_state": num_gdn * cfg.linear_num_value_heads * cfg.linear_key_head_dim
            * cfg.linear_value_head_dim * compute_dtype(self.lm_head.weight).itemsize,
            "conv_state": num_gdn * cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * self.lm_head.weight.itemsize,
        }
        out["total"] = sum(out.values())
        return out

    # -- native rollout ---------------------------------------------------------------------------------------
    def decoder(self, resident: Resident, batch: int, max_new_tokens: int, page_budget: int | None = None,
                response_chunk: int | None = None):
        """The static-shaped decode of `batch` responses of up to `max_new_tokens` tokens (qwen36/decode.py), its
        response slots `response_chunk` at first (None: all), grown in steps; with offloaded pages, at most
        `page_budget` bytes of them copied to the device (None: what fits)."""
        return Qwen36Decoder(self, resident, batch, max_new_tokens, page_budget, response_chunk)

    @torch.no_grad()
    def start_decode(self, resident: Resident, batch: int, capacity: int) -> DecodeState:
        """Per-sequence decode state for `batch` responses that share the resident prompt: empty response
        K/V (`capacity` slots) for attention layers, a copy of the prompt's conv + recurrent state per response for
        GDN layers."""
        cfg, w = self.config, self.lm_head.weight
        layers = []
        for layer, state in zip(self.model.layers, resident.layers):
            if layer.is_attention:
                layers.append(ResponseKV(batch, capacity, cfg.num_key_value_heads, cfg.head_dim,
                                       state.k_PKD.dtype, w.device))
            else:
                layers.append(RecurrentState(state.conv_CW.expand(batch, -1, -1).clone(),
                                             state.ssm_GKV.expand(batch, -1, -1, -1).clone()))
        return DecodeState(layers)
