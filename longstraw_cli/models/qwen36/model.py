"""qwen36 = HF `qwen3_5_text` (Qwen3.5/3.6 hybrid) in plain PyTorch, single device.

Three ways through the same weights:
- `forward(input_ids)`: the full-sequence reference (causal SDPA, chunked GDN from a zero state).
- `capture(prompt_ids)`: the prompt's resident state, block by block under no_grad. Only K/V pages of attention
  layers and conv + recurrent state of GDN layers survive a block; no logits are formed for prompt tokens.
- `logprobs(resident, response_ids, grad=...)`: replay from the last prompt token against the resident state,
  which is read, never written.
Module names mirror HF's so a checkpoint's state dict loads as it is.

Legend: B batch, T tokens, C hidden, Q query heads, K kv heads, D head dim, H GDN key heads, G GDN value heads,
Dk/Dv GDN head dims, X conv channels, W conv window (kernel - 1), P pages, V vocab.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from longstraw_cli.models.embedding import Embedding
from longstraw_cli.models.logprobs import token_logprobs
from longstraw_cli.models.qwen36.config import Qwen36Config
from longstraw_cli.models.qwen36.decode import Qwen36Decoder
from longstraw_cli.resident import AttentionPages, RecurrentState, Resident
from longstraw_kernels.attention import blockwise_causal_attention, replay_attention
from longstraw_kernels.attention.decode import decode_pages_attention
from longstraw_kernels.gdn import gdn_forward


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """HF computes these in fp32; fp64 stays fp64 so that fp64 tests test the algorithm, not fp32 rounding."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class RMSNorm(nn.Module):
    """fp32 RMSNorm scaled by (1 + w), w initialised to zero."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = at_least_fp32(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + at_least_fp32(self.weight))).type_as(x)


class GatedRMSNorm(nn.Module):
    """GDN output norm: plain w (init ones), then times silu(z)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = at_least_fp32(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(at_least_fp32(z))).to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def stop_grad_prefix(x_BT_: torch.Tensor, n: int) -> torch.Tensor:
    """Same values; positions < n carry no gradient (the prompt is a constant in response_only mode)."""
    if n <= 0:
        return x_BT_
    return torch.cat([x_BT_[:, :n].detach(), x_BT_[:, n:]], dim=1)


def rope_cos_sin(positions_T: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype):
    # fp32 angles, as HF computes them, then cast to the activations' dtype
    angle_dtype = torch.promote_types(dtype, torch.float32)
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=positions_T.device).to(angle_dtype)
    inv_freq = 1.0 / (theta ** (exponents / rotary_dim))
    freqs_TR = positions_T.to(angle_dtype)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs_TR, freqs_TR], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_partial_rope(x_BTHD: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor) -> torch.Tensor:
    rotary_dim = cos_TR.shape[-1]
    rot, rest = x_BTHD[..., :rotary_dim], x_BTHD[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    cos, sin = cos_TR[:, None, :], sin_TR[:, None, :]
    return torch.cat([rot * cos + rotated_half * sin, rest], dim=-1)


class DecodeKV:
    """Keys/values of the tokens generated so far, per sequence, preallocated for `capacity` tokens."""

    def __init__(self, batch: int, capacity: int, num_kv: int, head_dim: int, dtype, device):
        self.k_BSKD = torch.zeros(batch, capacity, num_kv, head_dim, dtype=dtype, device=device)
        self.v_BSKD = torch.zeros_like(self.k_BSKD)
        self.length = 0

    def append(self, k_BTKD: torch.Tensor, v_BTKD: torch.Tensor):
        end = self.length + k_BTKD.shape[1]
        self.k_BSKD[:, self.length : end].copy_(k_BTKD)
        self.v_BSKD[:, self.length : end].copy_(v_BTKD)
        self.length = end
        return self.k_BSKD[:, :end], self.v_BSKD[:, :end]


@dataclass
class DecodeState:
    """Decode state of a batch of responses: one entry per layer, and how many tokens were fed."""

    layers: list
    step: int = 0


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
        B, T, _ = x_BTC.shape
        q_BTQD, gate_BTQD = self.q_proj(x_BTC).view(B, T, self.num_q, 2 * self.head_dim).chunk(2, dim=-1)
        q_BTQD = self.q_norm(q_BTQD)
        k_BTKD = self.k_norm(self.k_proj(x_BTC).view(B, T, self.num_kv, self.head_dim))
        v_BTKD = self.v_proj(x_BTC).view(B, T, self.num_kv, self.head_dim)
        cos, sin = rope_cos_sin(positions_T, self.cfg.rotary_dim, self.cfg.rope_theta, q_BTQD.dtype)
        return apply_partial_rope(q_BTQD, cos, sin), apply_partial_rope(k_BTKD, cos, sin), v_BTKD, gate_BTQD

    def output(self, o_BTQD: torch.Tensor, gate_BTQD: torch.Tensor) -> torch.Tensor:
        B, T = o_BTQD.shape[:2]
        o_BTC = (o_BTQD * torch.sigmoid(gate_BTQD)).reshape(B, T, -1)
        return self.o_proj(o_BTC)

    def forward(self, x_BTC, positions_T, pages: AttentionPages | None = None, num_cached: int = 0,
                write: bool = False, grad_prefix: int = 0, decode: DecodeKV | None = None):
        """pages None: full causal attention over x. Otherwise attend to the pages (no mask) plus x's own keys
        (causal); with write=True x's keys are first stored as pages num_cached.. and only the pages before
        them are attended (block-by-block capture). With a decode cache, x's keys are appended to the
        per-sequence response keys, and all of those are attended."""
        q_BTQD, k_BTKD, v_BTKD, gate_BTQD = self.project(x_BTC, positions_T)
        if pages is None:
            k_BTKD, v_BTKD = stop_grad_prefix(k_BTKD, grad_prefix), stop_grad_prefix(v_BTKD, grad_prefix)
            o_BQTD = F.scaled_dot_product_attention(
                q_BTQD.transpose(1, 2), k_BTKD.transpose(1, 2), v_BTKD.transpose(1, 2),
                is_causal=True, scale=self.scale, enable_gqa=True,
            )
            return self.output(o_BQTD.transpose(1, 2), gate_BTQD)
        if not write:
            num_cached = pages.k_PKD.shape[0]
        else:
            end = num_cached + x_BTC.shape[1]
            pages.k_PKD[num_cached:end].copy_(k_BTKD[0])
            pages.v_PKD[num_cached:end].copy_(v_BTKD[0])
            # read back what replay will read, so capture and replay see the same (possibly rounded) keys
            k_BTKD, v_BTKD = pages.k_PKD[num_cached:end][None], pages.v_PKD[num_cached:end][None]
        if decode is not None:
            k_BTKD, v_BTKD = decode.append(k_BTKD, v_BTKD)
        o_BTQD = self.attention_fn(
            q_BTQD, pages.k_PKD[:num_cached], pages.v_PKD[:num_cached], k_BTKD, v_BTKD, scale=self.scale
        )
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
    full_BXS = torch.cat([window_BXW, mixed_BTX.transpose(1, 2)], dim=-1)
    return window_BXW, full_BXS[..., full_BXS.shape[-1] - window_BXW.shape[-1] :]


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
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, cfg.linear_conv_kernel_dim, groups=self.conv_dim, bias=False)
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

    def forward(self, x_BTC, state: RecurrentState | None = None, grad_prefix: int = 0):
        """-> (y_BTC, conv_BXW, ssm_BGKV): output and the state after x. `state` is read, never written."""
        B = x_BTC.shape[0]
        mixed_BTX = stop_grad_prefix(self.in_proj_qkv(x_BTC), grad_prefix)
        if state is None:
            window_BXW = mixed_BTX.new_zeros(B, self.conv_dim, self.window)
            ssm_BGKV = None
        else:
            window_BXW = state.conv_CW.to(mixed_BTX.dtype).expand(B, -1, -1)
            ssm_BGKV = state.ssm_GKV.expand(B, -1, -1, -1)
        return self.mix(x_BTC, mixed_BTX, window_BXW, ssm_BGKV, self.gdn_fn, grad_prefix)

    def capture_span(self, x_BTC, state: RecurrentState):
        """Layer-by-layer capture of a span: output, and `state` advanced to the end of the span."""
        mixed_BTX = self.in_proj_qkv(x_BTC)
        window_in_BXW, window_out_BXW = self.window_fn(mixed_BTX, state.conv_CW.to(mixed_BTX.dtype)[None])
        # window_fn's window, not mix's: under context parallel the span's end is not the prompt's end
        y_BTC, _, ssm_BGKV = self.mix(x_BTC, mixed_BTX, window_in_BXW, state.ssm_GKV[None], self.span_gdn_fn)
        state.conv_CW.copy_(window_out_BXW[0])
        state.ssm_GKV.copy_(ssm_BGKV[0])
        return y_BTC

    def mix(self, x_BTC, mixed_BTX, window_BXW, ssm_BGKV, gdn_fn, grad_prefix: int = 0):
        """Conv over (window, mixed), gates, the gated delta rule from ssm, gated norm, out_proj.
        -> (y_BTC, the conv window after mixed, ssm_BGKV after mixed)."""
        B, T, _ = x_BTC.shape
        full_BXS = torch.cat([window_BXW, mixed_BTX.transpose(1, 2)], dim=-1)
        conv_BXT = F.silu(F.conv1d(full_BXS, self.conv1d.weight, groups=self.conv_dim))
        q, k, v = torch.split(conv_BXT.transpose(1, 2), [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q_BTHK = l2norm(at_least_fp32(q.reshape(B, T, self.num_k, self.dk)))
        k_BTHK = stop_grad_prefix(l2norm(at_least_fp32(k.reshape(B, T, self.num_k, self.dk))), grad_prefix)
        v_BTGV = stop_grad_prefix(v.reshape(B, T, self.num_v, self.dv), grad_prefix)
        beta_BTG = stop_grad_prefix(self.in_proj_b(x_BTC).sigmoid(), grad_prefix)
        g_BTG = -at_least_fp32(self.A_log).exp() * F.softplus(at_least_fp32(self.in_proj_a(x_BTC)) + self.dt_bias)
        g_BTG = stop_grad_prefix(g_BTG, grad_prefix)
        o_BTGV, new_ssm_BGKV = gdn_fn(q_BTHK, k_BTHK, v_BTGV, g_BTG, beta_BTG, ssm_BGKV)
        z_BTGV = self.in_proj_z(x_BTC).reshape(B, T, self.num_v, self.dv)
        y_BTC = self.out_proj(self.norm(o_BTGV, z_BTGV).reshape(B, T, self.value_dim))
        return y_BTC, full_BXS[..., full_BXS.shape[-1] - self.window :], new_ssm_BGKV


class MLP(nn.Module):
    def __init__(self, cfg: Qwen36Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen36Config, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def is_attention(self) -> bool:
        return self.layer_type == "full_attention"

    def forward(self, x_BTC, positions_T, state=None, num_cached: int = 0, write: bool = False, grad_prefix: int = 0,
                decode=None):
        """-> (x, (conv, ssm) or None). `state`: this layer's resident entry (None: full-sequence reference);
        `decode`: the layer's per-sequence decode state (DecodeKV, or a batched RecurrentState for GDN)."""
        h = self.input_layernorm(x_BTC)
        new_state = None
        if self.is_attention:
            h = self.self_attn(h, positions_T, state, num_cached, write, grad_prefix, decode)
        else:
            h, conv_BXW, ssm_BGKV = self.linear_attn(h, state if decode is None else decode, grad_prefix)
            new_state = (conv_BXW, ssm_BGKV)
        x_BTC = x_BTC + h
        return x_BTC + self.mlp(self.post_attention_layernorm(x_BTC)), new_state


    def capture_span(self, x_BTC, positions_T, state, block_size: int):
        """Layer-by-layer capture over a whole span; the MLP runs in blocks so [T, FFN] never exists."""
        h = self.input_layernorm(x_BTC)
        if self.is_attention:
            x_BTC = x_BTC + self.self_attn.capture_span(h, positions_T, state, block_size)
        else:
            x_BTC = x_BTC + self.linear_attn.capture_span(h, state)
        for start in range(0, x_BTC.shape[1], block_size):
            block = x_BTC[:, start : start + block_size]
            block += self.mlp(self.post_attention_layernorm(block))
        return x_BTC


class Qwen36Backbone(nn.Module):
    def __init__(self, cfg: Qwen36Config):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t) for t in cfg.layer_types)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen36ForCausalLM(nn.Module):
    family = "qwen36"

    def __init__(self, cfg: Qwen36Config):
        super().__init__()
        self.config = cfg
        self.model = Qwen36Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02):
        """HF-style init: normal(0, std) linears/embeddings; (1+w) norms at zero; gated norm, dt_bias at one."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std)
            elif isinstance(module, RMSNorm):
                module.weight.zero_()
            elif isinstance(module, GatedRMSNorm):
                module.weight.fill_(1.0)
            elif isinstance(module, GatedDeltaNet):
                module.dt_bias.fill_(1.0)
                module.A_log.copy_(torch.empty_like(module.A_log).uniform_(0.01, 16).log())
                nn.init.kaiming_uniform_(module.conv1d.weight, a=math.sqrt(5))

    # -- reference path ---------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, grad_prefix: int = 0) -> torch.Tensor:
        """Logits [B, T, V] of a plain full-sequence forward. grad_prefix=n makes positions < n a constant
        (what response_only replay computes, by an independent route)."""
        ids_BT = input_ids[None] if input_ids.dim() == 1 else input_ids
        positions_T = torch.arange(ids_BT.shape[1], device=ids_BT.device)
        x_BTC = self.model.embed_tokens(ids_BT)
        for layer in self.model.layers:
            x_BTC, _ = layer(x_BTC, positions_T, grad_prefix=grad_prefix)
        logits = self.lm_head(self.model.norm(x_BTC))
        return logits[0] if input_ids.dim() == 1 else logits

    # -- resident state ---------------------------------------------------------------------------------------
    def empty_resident(self, num_tokens: int, page_dtype: torch.dtype | None = None) -> Resident:
        """Preallocated state for `num_tokens` captured tokens."""
        cfg, w = self.config, self.lm_head.weight
        page_dtype = page_dtype or w.dtype
        layers = []
        for layer in self.model.layers:
            if layer.is_attention:
                shape = (num_tokens, cfg.num_key_value_heads, cfg.head_dim)
                layers.append(AttentionPages(torch.zeros(shape, dtype=page_dtype, device=w.device),
                                             torch.zeros(shape, dtype=page_dtype, device=w.device)))
            else:
                gdn = layer.linear_attn
                conv = torch.zeros(gdn.conv_dim, gdn.window, dtype=w.dtype, device=w.device)
                # fp32 recurrent state (fp64 in fp64 models)
                ssm = torch.zeros(gdn.num_v, gdn.dk, gdn.dv, dtype=at_least_fp32(w).dtype, device=w.device)
                layers.append(RecurrentState(conv, ssm))
        return Resident(layers=layers, num_tokens=num_tokens, last_token=-1)

    def resident_bytes(self, num_tokens: int, page_dtype: torch.dtype | None = None) -> dict[str, int]:
        """Analytic size of the resident state: what `Resident.nbytes()` must report."""
        cfg = self.config
        page_size = (page_dtype or self.lm_head.weight.dtype).itemsize
        num_attn = sum(t == "full_attention" for t in cfg.layer_types)
        num_gdn = cfg.num_hidden_layers - num_attn
        out = {
            "kv_pages": num_attn * 2 * num_tokens * cfg.num_key_value_heads * cfg.head_dim * page_size,
            "recurrent_state": num_gdn * cfg.linear_num_value_heads * cfg.linear_key_head_dim
            * cfg.linear_value_head_dim * torch.promote_types(self.lm_head.weight.dtype, torch.float32).itemsize,
            "conv_state": num_gdn * cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * self.lm_head.weight.itemsize,
        }
        out["total"] = sum(out.values())
        return out

    @torch.no_grad()
    def capture(self, prompt_ids: torch.Tensor, block_size: int = 4096,
                page_dtype: torch.dtype | None = None) -> Resident:
        """Resident state of a 1-D prompt: its first P-1 tokens, `block_size` tokens at a time; the last token
        is kept for replay. Activation memory is bounded by one block."""
        if prompt_ids.dim() != 1 or prompt_ids.numel() == 0:
            raise ValueError(f"capture takes a non-empty 1-D prompt, got shape {tuple(prompt_ids.shape)}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        num_tokens = prompt_ids.numel() - 1
        resident = self.empty_resident(num_tokens, page_dtype)
        resident.last_token = int(prompt_ids[-1])
        for start in range(0, num_tokens, block_size):
            end = min(num_tokens, start + block_size)
            positions_T = torch.arange(start, end, device=prompt_ids.device)
            x_BTC = self.model.embed_tokens(prompt_ids[start:end])[None]
            for layer, state in zip(self.model.layers, resident.layers):
                x_BTC, new_state = layer(x_BTC, positions_T, state, num_cached=start, write=True)
                if new_state is not None:
                    state.conv_CW.copy_(new_state[0][0])
                    state.ssm_GKV.copy_(new_state[1][0])
        return resident

    @torch.no_grad()
    def capture_span(self, span_ids: torch.Tensor, *, start: int, num_tokens: int, last_token: int,
                     block_size: int = 4096, page_dtype: torch.dtype | None = None) -> Resident:
        """Layer-by-layer capture of prompt tokens [start, start + len(span_ids)) of a prompt whose captured part
        has `num_tokens` tokens: one layer over the whole span at a time. Context parallel runs it on each
        rank's span with the span hooks swapped; on one rank (start 0, the whole prompt) it equals `capture`.
        Activations are one span's hidden states; attention scores and MLP intermediates stay block-sized."""
        resident = self.empty_resident(span_ids.numel(), page_dtype)
        resident.num_tokens, resident.last_token = num_tokens, last_token
        positions_T = torch.arange(start, start + span_ids.numel(), device=span_ids.device)
        x_BTC = self.model.embed_tokens(span_ids)[None]
        for layer, state in zip(self.model.layers, resident.layers):
            x_BTC = layer.capture_span(x_BTC, positions_T, state, block_size)
        return resident

    # -- replay / scoring -------------------------------------------------------------------------------------
    def replay_hidden(self, resident: Resident, input_ids_BT: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states of tokens that follow the captured span, read against the resident state."""
        start = resident.num_tokens
        positions_T = torch.arange(start, start + input_ids_BT.shape[1], device=input_ids_BT.device)
        x_BTC = self.model.embed_tokens(input_ids_BT)
        for layer, state in zip(self.model.layers, resident.layers):
            x_BTC, _ = layer(x_BTC, positions_T, state)
        return self.model.norm(x_BTC)

    def logprobs(self, resident: Resident, response_ids: torch.Tensor, grad: bool = False,
                 chunk_size: int = 1024) -> torch.Tensor:
        """log p(r_i | prompt, r_<i) for each response token: [R] for a 1-D response, [B, R] for a batch of
        equal-length responses (right padding is harmless: every position only sees earlier ones).
        grad=True: differentiable w.r.t. the parameters, the resident state being a constant (response_only)."""
        ids_BR = response_ids[None] if response_ids.dim() == 1 else response_ids
        B = ids_BR.shape[0]
        last_B1 = torch.full((B, 1), resident.last_token, dtype=ids_BR.dtype, device=ids_BR.device)
        # replay [p_last, r_0 .. r_{R-2}] predicting r_0 .. r_{R-1}
        inputs_BR = torch.cat([last_B1, ids_BR[:, :-1]], dim=1)
        with torch.set_grad_enabled(grad):
            h_BRC = self.replay_hidden(resident, inputs_BR)
            logp_BR = token_logprobs(h_BRC, self.lm_head.weight, ids_BR, chunk_size)
        return logp_BR[0] if response_ids.dim() == 1 else logp_BR

    # -- native rollout ---------------------------------------------------------------------------------------
    def decoder(self, resident: Resident, batch: int, capacity: int):
        """The static-shaped decode of `batch` responses of up to `capacity` tokens (qwen36/decode.py)."""
        return Qwen36Decoder(self, resident, batch, capacity)

    @torch.no_grad()
    def start_decode(self, resident: Resident, batch: int, max_new_tokens: int) -> DecodeState:
        """Per-sequence decode state for `batch` responses that share the resident prompt: empty response
        K/V for attention layers, a copy of the prompt's conv + recurrent state per response for GDN layers."""
        cfg, w = self.config, self.lm_head.weight
        layers = []
        for layer, state in zip(self.model.layers, resident.layers):
            if layer.is_attention:
                layers.append(DecodeKV(batch, max_new_tokens, cfg.num_key_value_heads, cfg.head_dim,
                                       state.k_PKD.dtype, w.device))
            else:
                layers.append(RecurrentState(state.conv_CW.expand(batch, -1, -1).clone(),
                                             state.ssm_GKV.expand(batch, -1, -1, -1).clone()))
        return DecodeState(layers)

    @torch.no_grad()
    def decode_step(self, resident: Resident, decode: DecodeState, tokens_B: torch.Tensor) -> torch.Tensor:
        """Feed one token per sequence (the first is the prompt's last token); next-token logits [B, V]."""
        position = resident.num_tokens + decode.step
        positions_T = torch.arange(position, position + 1, device=tokens_B.device)
        x_BTC = self.model.embed_tokens(tokens_B[:, None])
        for layer, state, dec in zip(self.model.layers, resident.layers, decode.layers):
            x_BTC, new_state = layer(x_BTC, positions_T, state, decode=dec)
            if new_state is not None:
                dec.conv_CW, dec.ssm_GKV = new_state
        decode.step += 1
        return at_least_fp32(self.lm_head(self.model.norm(x_BTC))[:, 0])
