"""Expert parallelism for glm52's routed experts, applied from outside the model through its `experts_fn` hook.

The hook's contract (single device: `local_experts` in models/glm52/experts.py, a mirror of HF
`GlmMoeDsaExperts.forward`):

    experts_fn(x_NC, topk_idx_Nk, topk_w_Nk, gate_up_proj, down_proj) -> y_NC
    y[n] = sum_j topk_w[n, j] * down[e] @ (silu(gate) * up),  (gate, up) = chunk(gate_up[e] @ x[n], 2),
    e = topk_idx[n, j]

Under EP over a group of W ranks, rank r holds experts [r E/W, (r+1) E/W) (contiguous; `expert_bounds`,
`ep_shard`) as its own parameters, and one of two functions stands in for the hook:
- `ep_experts_alltoall` (tokens SHARDED, e.g. prompt capture under CP): every (token, expert) pair is sent to the
  expert's rank by one all_to_all_single, computed there and sent back by the reverse one; the origin weights and
  sums. Autograd-correct (each all-to-all's backward is the reverse all-to-all).
- `ep_experts_replicated` (tokens REPLICATED, e.g. replay, scoring, decode under CP): every rank computes its
  own experts' contributions for all tokens, and one all-reduce sums them.

A rank builds or loads only its slice (`models.build_model` / `from_pretrained` with
`expert_slice=ep_slice(group)`). Applied to a model by `apply_expert_parallel(model, ep_group, cp_group=...)`:
each MoE layer keeps its slice of the experts as its own nn.Parameters (taken here if the model was built
whole) and its `experts_fn` becomes an `EPExperts`, which picks the mode per call from a context flag: inside
`tokens_sharded()` (entered only by the glm52 CP capture, `cp_glm52.cp_capture_glm52`, which gives each rank
its own prompt shard) all-to-all, everywhere else (replay, scoring, decode, and any capture
without CP) replicated. The EP group must lie within the CP group (ep divides cp), so that EP ranks share the
prompt and responses and call the same collectives. `gather_expert_params` / `load_expert_params` convert
between the slices and full [E, ...] tensors (one process's view; checkpoints under EP are sharded instead, each rank
writing its own slices: `LocalStrategy.sharded_state_dict`).

Both give y equal to `local_experts` with all E experts (up to rounding: an expert's rows are batched with
other ranks' rows), and gradients equal to one rank's: dx and dw on the ranks that hold those tokens, and each
rank's expert slices the matching slices of the one-rank gradient (zeros, never None, for experts that received
no token, as the one-rank gradient of the 3-D parameter has).

`local_experts` and the pieces reused here (`pairs_by_expert`, `expert_ffn`, `combine`: HF's order of operations,
bit for bit) live beside the model in models/glm52/experts.py. Replicated mode sums the partials by all-reduce,
so in bf16 it agrees with one rank only up to rounding.

Legend: N tokens on this rank, k experts per token, C hidden, I expert intermediate, E experts in all,
L = E / W experts per rank, W ranks in the EP group, M (token, expert) pairs sent / received.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.distributed as dist
from torch import nn

from longstraw_cli.distributed.comm import rank_world
from longstraw_cli.models.glm52.experts import combine, expert_ffn, local_experts, pairs_by_expert

__all__ = ["apply_expert_parallel", "ep_experts_alltoall", "ep_experts_replicated", "ep_shard", "ep_slice",
           "expert_bounds",
           "gather_expert_params", "load_expert_params", "local_experts", "tokens_sharded"]



def expert_bounds(num_experts: int, num_ranks: int, rank: int) -> tuple[int, int]:
    """[start, end) of the experts rank `rank` of `num_ranks` holds: contiguous, E / W each."""
    if num_experts < 1 or num_ranks < 1 or num_experts % num_ranks:
        raise ValueError(f"expert parallel needs the number of experts ({num_experts}) divisible by the EP group "
                         f"size ({num_ranks}); group sizes that divide it: "
                         f"{[n for n in range(1, max(num_experts, 0) + 1) if num_experts % n == 0]}")
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank {rank} outside an EP group of {num_ranks}")
    num_local = num_experts // num_ranks
    return rank * num_local, (rank + 1) * num_local


def ep_slice(group):
    """The `expert_slice` of models.build_model / from_pretrained for this rank of an EP group: num_experts ->
    this rank's `expert_bounds`. None (every expert) without a group or in a group of one rank."""
    if group is None:
        return None
    rank, world = rank_world(group)
    if world == 1:
        return None
    return lambda num_experts: expert_bounds(num_experts, world, rank)


def ep_shard(full_E: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's experts of a full [E, ...] tensor (e.g. gate_up_proj, down_proj): a contiguous detached copy,
    so the full tensor can be freed. Wrap it in nn.Parameter to make it the rank's own parameter."""
    rank, world = rank_world(group)
    start, end = expert_bounds(full_E.shape[0], world, rank)
    return full_E.detach()[start:end].clone()


def _check_experts(x_NC, topk_idx_Nk, topk_w_Nk, gate_up_L2IC, down_LCI, num_local):
    if (x_NC.dim() != 2 or topk_idx_Nk.dim() != 2 or topk_idx_Nk.shape[0] != x_NC.shape[0]
            or topk_w_Nk.shape != topk_idx_Nk.shape):
        raise ValueError(f"need x [N, C], topk_idx [N, k], topk_w [N, k]; got {tuple(x_NC.shape)}, "
                         f"{tuple(topk_idx_Nk.shape)}, {tuple(topk_w_Nk.shape)}")
    C = x_NC.shape[1]
    L, two_I, C_g = gate_up_L2IC.shape if gate_up_L2IC.dim() == 3 else (-1, -1, -1)
    if (L != num_local or two_I % 2 or C_g != C
            or tuple(down_LCI.shape) != (num_local, C, two_I // 2)):
        raise ValueError(f"need this rank's {num_local} experts as gate_up [{num_local}, 2I, {C}] and down "
                         f"[{num_local}, {C}, I]; got {tuple(gate_up_L2IC.shape)} and {tuple(down_LCI.shape)}")


def _check_ids(topk_idx_Nk, num_experts):
    # One host sync; the dispatch below syncs anyway, and a bad id would otherwise be silently dropped.
    if topk_idx_Nk.numel():
        lo, hi = torch.aminmax(topk_idx_Nk)
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"expert ids must lie in [0, {num_experts}), got [{int(lo)}, {int(hi)}]")


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows with the given split sizes; the backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x_MC, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out_MC = x_MC.new_empty((sum(out_splits), *x_MC.shape[1:]))
        dist.all_to_all_single(out_MC, x_MC.contiguous(), out_splits, in_splits, group=group)
        return out_MC

    @staticmethod
    def backward(ctx, grad_MC):
        out_splits, in_splits = ctx.splits
        dx_MC = grad_MC.new_empty((sum(in_splits), *grad_MC.shape[1:]))
        dist.all_to_all_single(dx_MC, grad_MC.contiguous(), in_splits, out_splits, group=ctx.group)
        return dx_MC, None, None, None


def ep_experts_alltoall(x_NC, topk_idx_Nk, topk_w_Nk, gate_up_local, down_local, *, group=None,
                        num_experts: int):
    """Routed experts for tokens SHARDED across the EP group: -> y_NC for this rank's tokens, equal to
    `local_experts` with all experts up to rounding.

    N may differ between ranks (0 included); k, C, I and dtypes may not. Collective: every rank of the group
    calls it (with x, w requiring grad on all or none), and under autograd every rank backpropagates through
    its output. Three collectives forward (split sizes, tokens, results), two backward.
    """
    rank, world = rank_world(group)
    start, end = expert_bounds(num_experts, world, rank)
    L = end - start
    _check_experts(x_NC, topk_idx_Nk, topk_w_Nk, gate_up_local, down_local, L)
    _check_ids(topk_idx_Nk, num_experts)
    if world == 1:
        return local_experts(x_NC, topk_idx_Nk, topk_w_Nk, gate_up_local, down_local)
    k = topk_idx_Nk.shape[1]
    # pairs by expert id, so grouped by destination rank and, inside it, by that rank's local expert
    pairs_M, send_counts_E = pairs_by_expert(topk_idx_Nk, 0, num_experts)
    # recv_counts_WL[s, e]: pairs rank s sends to this rank's local expert e
    recv_counts_E = torch.empty_like(send_counts_E)
    dist.all_to_all_single(recv_counts_E, send_counts_E, group=group)
    recv_counts_WL = recv_counts_E.view(world, L)
    sizes = torch.cat([send_counts_E.view(world, L).sum(1), recv_counts_WL.sum(1), recv_counts_WL.sum(0)])
    sizes = sizes.tolist()
    send_W, recv_W, recv_per_expert_L = sizes[:world], sizes[world:2 * world], sizes[2 * world:]

    x_recv_MC = _AllToAll.apply(x_NC[pairs_M // k], recv_W, send_W, group)
    # Received rows come per source rank, each block sorted by expert: regroup them by expert for the FFN.
    expert_recv_M = torch.arange(L, device=x_NC.device).repeat(world).repeat_interleave(
        recv_counts_WL.reshape(-1), output_size=sum(recv_W))
    by_expert_M = expert_recv_M.argsort(stable=True)
    y_grouped_MC = expert_ffn(x_recv_MC[by_expert_M], recv_per_expert_L, gate_up_local, down_local)
    y_recv_MC = y_grouped_MC[by_expert_M.argsort()]
    y_back_MC = _AllToAll.apply(y_recv_MC, send_W, recv_W, group)
    return combine(y_back_MC, pairs_M, topk_idx_Nk, topk_w_Nk, x_NC)


class _SumAcrossRanks(torch.autograd.Function):
    """All-reduce sum forward; the backward passes the gradient through unchanged (not all-reduced again).

    Why unchanged: the tokens, and so the output y = sum_r partial_r and the loss, are replicated on every rank,
    and every rank backpropagates the same dL/dy. Rank r's partial depends only on its own experts, and
    dL/dpartial_r = dL/dy * dy/dpartial_r = dL/dy. An all-reduce here would multiply it by W.
    """

    @staticmethod
    def forward(ctx, partial_NC, group):
        y_NC = partial_NC.clone()
        dist.all_reduce(y_NC, group=group)
        return y_NC

    @staticmethod
    def backward(ctx, dy_NC):
        return dy_NC, None


class _ReplicatedInputs(torch.autograd.Function):
    """Identity on (x, w) forward; the backward sums their gradients over the group (one packed all-reduce).

    x and w are replicated, but the gradient reaching them through this rank's partial covers only this rank's
    experts: the full dx (dw) is the sum over ranks. Every rank ends with the full dx and dw.
    """

    @staticmethod
    def forward(ctx, x_NC, topk_w_Nk, group):
        ctx.group = group
        return x_NC.view_as(x_NC), topk_w_Nk.view_as(topk_w_Nk)

    @staticmethod
    def backward(ctx, dx_NC, dw_Nk):
        # requires_grad of x and w is the same on every rank, so every rank packs the same tensors.
        grads = [g for g, needed in zip((dx_NC, dw_Nk), ctx.needs_input_grad) if needed]
        dtype = torch.promote_types(*(g.dtype for g in grads)) if len(grads) > 1 else grads[0].dtype
        # Summed in the wider dtype of the two (fp32 for bf16 x with fp32 w), rounded back once.
        packed = torch.cat([g.reshape(-1).to(dtype) for g in grads])
        dist.all_reduce(packed, group=ctx.group)
        out = iter(packed.split([g.numel() for g in grads]))
        return (*(next(out).view_as(g).to(g.dtype) if needed else None
                  for g, needed in zip((dx_NC, dw_Nk), ctx.needs_input_grad[:2])), None)


def ep_experts_replicated(x_NC, topk_idx_Nk, topk_w_Nk, gate_up_local, down_local, *, group=None,
                          num_experts: int):
    """Routed experts for tokens REPLICATED on every rank of the EP group: -> y_NC, the same on every rank,
    equal to `local_experts` with all experts up to the rounding of the all-reduce.

    x, topk_idx, topk_w must be identical on every rank, and so must the loss backpropagated through y: then
    every rank gets the full one-rank dx and dw, and its own experts' slices of the one-rank expert gradients.
    Collective: one all-reduce forward, one backward (for dx, dw; none when neither requires grad).
    """
    rank, world = rank_world(group)
    start, end = expert_bounds(num_experts, world, rank)
    _check_experts(x_NC, topk_idx_Nk, topk_w_Nk, gate_up_local, down_local, end - start)
    _check_ids(topk_idx_Nk, num_experts)
    if world == 1:
        return local_experts(x_NC, topk_idx_Nk, topk_w_Nk, gate_up_local, down_local)
    if torch.is_grad_enabled() and (x_NC.requires_grad or topk_w_Nk.requires_grad):
        x_NC, topk_w_Nk = _ReplicatedInputs.apply(x_NC, topk_w_Nk, group)
    partial_NC = local_experts(x_NC, topk_idx_Nk, topk_w_Nk, gate_up_local, down_local, first_expert=start)
    return _SumAcrossRanks.apply(partial_NC, group)


# -- applying EP to a model ----------------------------------------------------------------------------------------
# Whether the tokens that reach the experts are SHARDED across the EP group (prompt capture under context
# parallel) or REPLICATED (replay, scoring, decode: the response is on every rank). Replicated is the default;
# only the CP capture, which knows it shards the prompt, says otherwise.
_TOKENS_SHARDED = contextvars.ContextVar("tokens_sharded", default=False)


@contextlib.contextmanager
def tokens_sharded():
    """Within this block the experts see SHARDED tokens (each rank its own): EP dispatches by all-to-all."""
    reset = _TOKENS_SHARDED.set(True)
    try:
        yield
    finally:
        _TOKENS_SHARDED.reset(reset)


class EPExperts:
    """A MoE layer's `experts_fn` under EP: all-to-all inside `tokens_sharded()`, replicated otherwise."""

    def __init__(self, group, num_experts: int):
        self.group, self.num_experts = group, num_experts

    def __call__(self, x_NC, topk_idx_Nk, topk_w_Nk, gate_up_local, down_local):
        fn = ep_experts_alltoall if _TOKENS_SHARDED.get() else ep_experts_replicated
        return fn(x_NC, topk_idx_Nk, topk_w_Nk, gate_up_local, down_local, group=self.group,
                  num_experts=self.num_experts)


def _moe_layers(model):
    return [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts_fn")]


def apply_expert_parallel(model, group, *, cp_group) -> None:
    """Each MoE layer keeps only this rank's contiguous slice of the routed experts (its own nn.Parameters) and
    dispatches tokens through `EPExperts`. A model built with this rank's slice (`ep_slice`: what the trainer
    builds, so no rank ever holds another's experts) is kept as it is; a model holding every expert is sliced
    here (a copy of the slice, the whole freed). The EP group must lie within the CP group: EP ranks then hold
    the same prompt and response, so they call the same collectives in the same order (ranks with different
    prompts would not: rollout and response lengths differ). cp=1 with ep=1 changes nothing."""
    rank, world = rank_world(group)
    if world == 1:
        return
    ep_ranks = set(dist.get_process_group_ranks(group))
    cp_ranks = set(dist.get_process_group_ranks(cp_group)) if cp_group is not None else {dist.get_rank()}
    if not ep_ranks <= cp_ranks:
        raise ValueError(f"the EP group (global ranks {sorted(ep_ranks)}) must lie within the CP group (global "
                         f"ranks {sorted(cp_ranks)}): ep must divide cp, with EP groups of ranks sharing a prompt")
    num_experts = model.config.n_routed_experts
    own = expert_bounds(num_experts, world, rank)
    for moe in _moe_layers(model):
        experts = moe.experts
        if experts.expert_rows == (0, num_experts):
            experts.gate_up_proj = nn.Parameter(ep_shard(experts.gate_up_proj, group))
            experts.down_proj = nn.Parameter(ep_shard(experts.down_proj, group))
            experts.expert_rows = own
        elif experts.expert_rows != own:
            raise ValueError(f"the model holds experts {list(experts.expert_rows)} but rank {rank} of an EP group "
                             f"of {world} holds {list(own)}: build it with ep_slice(group) or with every expert")
        moe.experts_fn = EPExperts(group, num_experts)


def is_expert_param(name: str) -> bool:
    return name.endswith(("experts.gate_up_proj", "experts.down_proj"))


def gather_rows(slice_E: torch.Tensor, group) -> torch.Tensor:
    """The whole [E, ...] tensor from every rank's contiguous slice of experts (collective)."""
    _, world = rank_world(group)
    parts = [torch.empty_like(slice_E) for _ in range(world)]
    dist.all_gather(parts, slice_E.detach().contiguous(), group=group)
    return torch.cat(parts)


def gather_expert_params(model, group) -> dict[str, torch.Tensor]:
    """{parameter name: full [E, ...] tensor} of every routed-expert parameter, on every rank (checkpointing)."""
    return {name: gather_rows(p, group) for name, p in model.named_parameters() if is_expert_param(name)}


@torch.no_grad()
def load_expert_params(model, full: dict[str, torch.Tensor], group) -> None:
    """The inverse of `gather_expert_params`: copy this rank's slice of each full [E, ...] tensor in."""
    params = dict(model.named_parameters())
    for name, tensor in full.items():
        params[name].copy_(ep_shard(tensor, group))
