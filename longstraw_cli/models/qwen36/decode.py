"""qwen36 native decode: one static-shaped step for G responses that share the resident prompt.

Everything a step touches is allocated before it runs: each attention layer's response keys/values
[B, capacity, K, D] (filled at slot `step`, read under a validity mask; the capacity grows in steps with the
response, models/slots.py), each GDN layer's conv window and fp32 recurrent state per response (copied from the
prompt's once). The token ids and the step counter are device tensors, updated in place. So a step has no
Python-side shape changes and no host synchronisation, and can be captured once per capacity and replayed as a
CUDA graph (rollout/native.py).

Attention reads the prompt pages once per step for all responses (cascade attention: responses and a kv
group's query heads are the rows of one call over the pages, merged by log-sum-exp with each response's own
keys). GDN takes one recurrent step per response, on CUDA in two Triton launches a layer: the conv, moving its
window on in place (`conv_step`), then the q/k norms, the gates and the recurrence, advancing the state in place
(`gdn_decode`). The projections, norms and MLP are
the model's own modules, so decode computes what replay computes, in another order of summation (and the conv and
beta = sigmoid(b) in fp32 where the model's paths round them to the activations' dtype first, as HF does).

Offloaded K/V pages (`capture.offload=cpu`): every decode token reads every attention layer's K/V in full (dense
attention), so there is no subset to fetch. The decoder copies as many layers' pages to the device as fit in its
free memory, once for the rollout (`resident.offload.rollout_pages`; when all fit, the step is CUDA-graph safe,
as on the device); each step stages the other layers' pages one at a time from the host (the next layer's copy
overlapping the current layer), eagerly: a token then moves those layers' K/V over the host link (PCIe, ~50 GB/s
at best on an H200 host), e.g. all 12 GiB of qwen36_mini's at 1M tokens when none fit, ~0.25 s a token.

Each layer's linears that read the same input (GDN's in_proj_qkv / z / b / a, attention's q / k / v, the MLP's
gate and up) run as one GEMM over their weights concatenated (`InProjections`), copied once per rollout: at 8 rows
the step's GEMMs are small enough that each costs a launch and a partly idle GPU (qwen36_mini on an H200: its 186
GEMMs 1.37 ms as one graph, the 96 of the concatenated form 1.04 ms; scripts/bench/bench_decode_gemms.py). The
copies cost their bytes while the rollout runs (qwen36_mini 1.9 GB), so they are made only where they come to at
most a 16th of the device's memory (`FUSED_SHARE`; not the 27B shape's 33 GB, whose full fine-tuning runs near the
memory's limit), and before an offloaded rollout's page copies, which take the free memory left. Otherwise, and
for linears that are not plain (LoRA adapters, NF4 weights, sharded parameters), they run one by one, as before.

On CUDA with Triton, a layer whose linears are all plain runs them as four launches of the decode linear kernel
(`KernelLinears`, longstraw_kernels/linear): the input norm inside the mixer's input GEMM, the output linear with
the residual add (GDN's gated output norm inside it too, where the kernel takes its heads), the post-attention
norm, gate, up and silu * up in one, down with the residual add (qwen36_mini on an H200: the compiled step 451 ->
301 launches, the trainer's decode loop 3.35 -> 3.20 ms a step; with K split for the narrow linears, the pages in
fewer splits and the gated norm, 2.90 ms). Elsewhere the modules run (`ModuleLinears`);
`kernels.decode_linear=torch` forces them.

The attention layers' query / key norms, RoPE and both cache writes run as one Triton launch a layer
(attention/triton_decode_qk.py) where it serves (CUDA, bf16/fp16, a power-of-two head dim; qwen36_mini's step 2.912
-> 2.844 ms in `longstraw train` on an H200); `kernels.decode_qk=torch` keeps the modules.

Legend: B responses, S response capacity, C hidden, Q query heads, K kv heads, D head dim, X conv channels,
W conv window, G GDN value heads, Dk/Dv GDN head dims, V vocab.
"""

from __future__ import annotations

import torch
from torch import nn

from longstraw_cli.models.core import StaticDecoder
from longstraw_cli.models.projections import concatenated_bytes, fusable, one_gemm_each
from longstraw_cli.models.qwen36.rope import rope_cos_sin
from longstraw_cli.models.slots import ResponseSlots, slot_buffer
from longstraw_cli.resident import Resident
from longstraw_cli.resident.offload import device_total_bytes, left_on_host, rollout_pages, stage_rollout_pages
from longstraw_kernels import kernel_choice, optional_module, say_once
from longstraw_kernels.attention.decode import (
    cascade_decode_attention,
    decode_pages_attention,
    say_where_the_references_run,
)
from longstraw_kernels.gdn import conv_step, gdn_decode
from longstraw_kernels.linear import gate_serves, kernel_entry


class ResponseKV(ResponseSlots):
    """One attention layer's keys/values of the generated tokens, per response, in `capacity` slots (grown by the
    decoder)."""

    SLOTS = ("k_BSKD", "v_BSKD")

    def __init__(self, batch: int, capacity: int, num_kv: int, head_dim: int, dtype, device):
        self.k_BSKD = slot_buffer(batch, capacity, num_kv, head_dim, dtype=dtype, device=device)
        self.v_BSKD = slot_buffer(batch, capacity, num_kv, head_dim, dtype=dtype, device=device)


class ResponseRecurrent:
    """One GDN layer's conv window and recurrent state, per response (copies: the prompt's state is shared); the
    window is moved on in place each step."""

    def __init__(self, conv_CW: torch.Tensor, ssm_GKV: torch.Tensor, batch: int):
        self.conv_BXW = conv_CW.expand(batch, -1, -1).clone()
        self.ssm_BGKV = ssm_GKV.expand(batch, -1, -1, -1).clone()

    def tensors(self) -> list[torch.Tensor]:
        return [self.conv_BXW, self.ssm_BGKV]


# by layer type, the (mixer's, MLP's) linears that read one input: one GEMM each (plan/qwen36.py counts the same)
INPUT_GROUPS = {"full_attention": (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")),
                "linear_attention": (("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), ("gate_proj", "up_proj"))}


def input_linears(model) -> list[tuple[list[nn.Module], list[nn.Module]]]:
    """Each layer's (mixer's input linears, the MLP's gate and up): the groups that read one input."""
    mixer_names, mlp_names = zip(*(INPUT_GROUPS[layer.layer_type] for layer in model.model.layers))
    return [([getattr(layer.mixer, n) for n in mixer], [getattr(layer.mlp, n) for n in mlp])
            for layer, mixer, mlp in zip(model.model.layers, mixer_names, mlp_names)]


class ModuleLinears:
    """A layer's linears as its modules run them, around the mixer: the input norm, then the mixer's input linears
    (`mixer_in`: one GEMM or one by one); the output linear and the residual add; the post-attention norm, the MLP's
    gate and up (`mlp_in`), silu * up, down and the residual add."""

    def __init__(self, layer, mixer_in, mlp_in):
        self.layer, self.mixer_in, self.mlp_in = layer, mixer_in, mlp_in

    def mixer_inputs(self, x_BTC: torch.Tensor) -> list[torch.Tensor]:
        return self.mixer_in(self.layer.input_layernorm(x_BTC))

    def mixer_residual(self, x_BTC: torch.Tensor, gated_BTX: torch.Tensor) -> torch.Tensor:
        return x_BTC + output_linear(self.layer)(gated_BTX)

    def gdn_residual(self, x_BTC: torch.Tensor, o_BTGV: torch.Tensor, z_BTX: torch.Tensor) -> torch.Tensor:
        """GDN's output: its gated norm of the recurrence's output by z, out_proj, the residual add."""
        return self.mixer_residual(x_BTC, self.layer.linear_attn.gated(o_BTGV, z_BTX))

    def mlp_residual(self, x_BTC: torch.Tensor) -> torch.Tensor:
        return x_BTC + self.layer.mlp.swiglu(*self.mlp_in(self.layer.post_attention_layernorm(x_BTC)))


class KernelLinears:
    """The same, four launches of the decode linear kernel (longstraw_kernels/linear): the norms in the input linears'
    prologue (GDN's gated output norm too, where `gated` says the kernel takes it), silu * up and the residual adds
    in their epilogues. The input groups' weights: the concatenated copy (`InProjections`) where the decoder made
    one, else each linear's own (one launch each). `linear`: the kernel's entry (`kernel_entry`), looked up once,
    outside the compiled step."""

    def __init__(self, layer, mixer_in, mlp_in, linear, gated: bool = False):
        self.layer, self.linear, self.gated = layer, linear, gated
        self.mixer_weights, self.sizes = mixer_in.weights()
        weights, sizes = mlp_in.weights()
        # the gate's and the up's rows of the one copy, or their own weights
        self.gate_NC, self.up_NC = weights[0].split(sizes) if len(weights) == 1 else weights

    def mixer_inputs(self, x_BTC: torch.Tensor) -> list[torch.Tensor]:
        norm = self.layer.input_layernorm
        outs = [self.linear(x_BTC, w, norm_K=norm.weight, eps=norm.eps) for w in self.mixer_weights]
        return outs[0].split(self.sizes, dim=-1) if len(outs) == 1 else outs

    def mixer_residual(self, x_BTC: torch.Tensor, gated_BTX: torch.Tensor) -> torch.Tensor:
        return self.linear(gated_BTX, output_linear(self.layer).weight, residual=x_BTC)

    def gdn_residual(self, x_BTC: torch.Tensor, o_BTGV: torch.Tensor, z_BTX: torch.Tensor) -> torch.Tensor:
        gdn = self.layer.linear_attn
        if not self.gated:
            return self.mixer_residual(x_BTC, gdn.gated(o_BTGV, z_BTX))
        B, T = z_BTX.shape[:2]
        return self.linear(o_BTGV.reshape(B, T, -1), gdn.out_proj.weight, gate=z_BTX, gate_norm_V=gdn.norm.weight,
                           eps=gdn.norm.eps, residual=x_BTC)

    def mlp_residual(self, x_BTC: torch.Tensor) -> torch.Tensor:
        norm = self.layer.post_attention_layernorm
        act_BTI = self.linear(x_BTC, self.gate_NC, up_NK=self.up_NC, norm_K=norm.weight, eps=norm.eps)
        return self.linear(act_BTI, self.layer.mlp.down_proj.weight, residual=x_BTC)


def output_linear(layer) -> nn.Module:
    """The mixer's output linear (attention's o_proj, GDN's out_proj)."""
    return layer.self_attn.o_proj if layer.is_attention else layer.linear_attn.out_proj


def layer_linears(layer, groups, projections, example_BTC: torch.Tensor,
                  norm_type: type) -> KernelLinears | ModuleLinears:
    """`KernelLinears` where the decode linear kernel serves every linear of `layer` for inputs like `example_BTC`
    (plain linears, norms of `norm_type` before the input groups, the kernel dispatched for each weight: CUDA,
    Triton, dtype), else `ModuleLinears`. norm_type: the model's RMSNorm (its final norm's class: this module does
    not import the model's), whose (1 + g) scaling the kernel's prologue computes."""
    linears = [output_linear(layer), layer.mlp.down_proj] + [m for group in groups for m in group]
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    entry = None
    if fusable(linears) and all(type(n) is norm_type for n in norms):
        entry = kernel_entry(example_BTC, *(m.weight for m in linears))
    if entry is None:
        return ModuleLinears(layer, *projections)
    # GDN's output norm in out_proj's prologue where the kernel takes its heads
    gated = not layer.is_attention and gate_serves(output_linear(layer).in_features, layer.linear_attn.norm.weight,
                                                   example_BTC.dtype)
    return KernelLinears(layer, *projections, entry, gated)


def fused_bytes(model) -> int:
    """Bytes of the concatenated input linears (every fusable group's weights)."""
    return concatenated_bytes(input_linears(model))


def qk_kernel_serves(model, resident: Resident, dtype: torch.dtype) -> bool:
    """Whether the fused q / k kernel takes this decode: bf16/fp16 activations, every attention layer's pages (so
    its response slots) in their dtype, a power-of-two head dim."""
    head_dim = model.config.head_dim
    return (dtype in (torch.bfloat16, torch.float16) and head_dim & (head_dim - 1) == 0
            and all(state.k_PKD.dtype == dtype for layer, state in zip(model.model.layers, resident.layers)
                    if layer.is_attention))


class Qwen36Decoder(StaticDecoder):
    """`step()` feeds `tokens_B` at position num_tokens + step and returns next-token logits [B, V] (fp32+)."""

    def __init__(self, model, resident: Resident, batch: int, max_new_tokens: int, page_budget: int | None = None,
                 response_chunk: int | None = None):
        super().__init__(model, resident, batch, max_new_tokens, response_chunk)
        cfg = model.config
        # each layer's (mixer's input linears, the MLP's gate and up) as one GEMM each where they allow, up to
        # FUSED_SHARE; made before the offloaded pages' copies below, which take what free memory is left
        self.projections = one_gemm_each(input_linears(model), device_total_bytes(self.device))
        # the decode linear kernel where it serves the layer (CUDA, Triton, plain linears), the modules elsewhere
        example_BTC = torch.empty(batch, 1, cfg.hidden_size, dtype=model.lm_head.weight.dtype, device=self.device)
        self.linears = [layer_linears(layer, groups, proj, example_BTC, type(model.model.norm))
                        for layer, groups, proj in zip(model.model.layers, input_linears(model), self.projections)]
        # offloaded pages: device copies of the layers that fit, made for the whole rollout; the rest staged per step
        self.pages = rollout_pages(resident, self.device, page_budget)
        self.on_host = left_on_host(resident, self.pages)
        # no host synchronisation and static shapes: a CUDA graph may replay step(); not while it stages pages
        self.graph_safe = not any(self.on_host)
        # torch.compile fuses the step's small kernels (seen on an H200: 7.7 -> 4.2 ms at 256K, G=8); a
        # cross-rank hook (context parallel) keeps its collectives out of the compiler
        self.compile_safe = all(layer.self_attn.decode_pages_fn is decode_pages_attention
                                for layer in model.model.layers if layer.is_attention)
        # each attention layer's pages attention: its hook (context parallel swaps in a cross-rank one)
        self.pages_fns = [layer.self_attn.decode_pages_fn if layer.is_attention else None
                          for layer in model.model.layers]
        self.qk = self._qk_kernel(model, resident, example_BTC)
        for page_dtype in {state.k_PKD.dtype for layer, state in zip(model.model.layers, resident.layers)
                           if layer.is_attention}:
            say_where_the_references_run(self.device, example_BTC.dtype, page_dtype, cfg.head_dim)
        self.layers = []
        for layer, state, pages in zip(model.model.layers, resident.layers, self.pages):
            if layer.is_attention:
                self.layers.append(ResponseKV(batch, self.capacity, cfg.num_key_value_heads, cfg.head_dim,
                                              state.k_PKD.dtype, self.device))
                # the page count is a dynamic size of the compiled step, so that one graph (and its on-disk cache
                # entry) serves every prompt length instead of one per length
                torch._dynamo.maybe_mark_dynamic(pages.k_PKD, 0)
                torch._dynamo.maybe_mark_dynamic(pages.v_PKD, 0)
            else:
                self.layers.append(ResponseRecurrent(state.conv_CW, state.ssm_GKV, batch))

    def step(self) -> torch.Tensor:
        model = self.model
        x_BTC, positions_1 = self.embed()
        stage = stage_rollout_pages(self.pages, self.device, self.on_host)
        for i, (layer, state, linears) in enumerate(zip(model.model.layers, self.layers, self.linears)):
            inputs = linears.mixer_inputs(x_BTC)
            if layer.is_attention:
                x_BTC = linears.mixer_residual(x_BTC, self._attention(
                    layer.self_attn, inputs, positions_1, stage(i), state, self.pages_fns[i]))
            else:
                x_BTC = linears.gdn_residual(x_BTC, *self._gdn(layer.linear_attn, inputs, state))
            x_BTC = linears.mlp_residual(x_BTC)
        return self.logits(x_BTC)

    @staticmethod
    def _qk_kernel(model, resident: Resident, example_BTC: torch.Tensor):
        """The fused q / k kernel's entry where kernels.decode_qk is auto and it serves this decode (CUDA, Triton,
        `qk_kernel_serves`), else None; on CUDA, where it does not serve, said once (as the decode's linears say
        it). CPU runs keep the modules (Triton's interpreter runs the kernel in its own tests)."""
        if kernel_choice("decode_qk") != "auto" or not example_BTC.is_cuda:
            return None
        module = optional_module("longstraw_kernels.attention.triton_decode_qk")
        if module is not None and qk_kernel_serves(model, resident, example_BTC.dtype):
            return module.decode_qk
        say_once("decode: the fused q / k kernel does not serve here (it needs Triton, bf16/fp16 activations and "
                 "pages alike, and a power-of-two head dim); the modules run")
        return None

    def _attention(self, attn, qkv: list[torch.Tensor], positions_1, pages, kv: ResponseKV, pages_fn):
        if self.qk is not None:
            # the norms, RoPE and both cache writes in one launch
            qg_BTX, k_BTX, v_BTX = qkv
            cos, sin = rope_cos_sin(positions_1, attn.cfg.rotary_dim, attn.cfg.rope_theta, qg_BTX.dtype)
            q_BQD = self.qk(qg_BTX, k_BTX, v_BTX, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps, cos, sin,
                            self.step_1, kv.k_BSKD, kv.v_BSKD)
            gate_BTQD = attn.split_query_gate(qg_BTX)[1]
        else:
            q_BTQD, k_BTKD, v_BTKD, gate_BTQD = attn.project_from(*qkv, positions_1)
            kv.k_BSKD.index_copy_(1, self.step_1, k_BTKD.to(kv.k_BSKD.dtype))
            kv.v_BSKD.index_copy_(1, self.step_1, v_BTKD.to(kv.v_BSKD.dtype))
            q_BQD = q_BTQD[:, 0]
        o_BQD = cascade_decode_attention(q_BQD, pages.k_PKD, pages.v_PKD, kv.k_BSKD, kv.v_BSKD,
                                         self.num_filled(), scale=attn.scale, pages_fn=pages_fn)
        return attn.gated(o_BQD[:, None], gate_BTQD)

    def _gdn(self, gdn, inputs: list[torch.Tensor], state: ResponseRecurrent):
        """-> (the recurrence's output o_BTGV, the gate z_BTX of its output norm)."""
        mixed_BTX, z_BTX, b_BTG, a_BTG = inputs
        # on CUDA two launches: the conv (its window moved on in place), then the q/k norms, the gates and the
        # recurrence (the state advanced in place)
        q_BTHK, k_BTHK, v_BTGV = gdn.split_heads(conv_step(mixed_BTX, state.conv_BXW, gdn.conv1d.weight))
        return gdn_decode(q_BTHK, k_BTHK, v_BTGV, a_BTG, b_BTG, gdn.A_log, gdn.dt_bias, state.ssm_BGKV), z_BTX
