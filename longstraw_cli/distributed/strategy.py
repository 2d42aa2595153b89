"""Gradient finalization over the data-parallel ranks: one reduction per optimizer step, none during replays.

The Transaction drives a strategy through one optimizer step of G replays:

    with strategy.full_weights():                  # capture, scoring: graph-free
        ...
    for i in range(G):
        with strategy.replay(i, G) as logprobs:    # logprobs(resident, ids, chunk_size=...) with autograd
            strategy.backward(loss(logprobs(...)))
    grad_norm = strategy.finalize()                # gradients final on every rank, clipped; the global norm
    strategy.step()

- `local`: one data-parallel rank (one process, or all ranks in one context-parallel group): nothing to reduce.
  Every strategy name runs as `local` when dp == 1.
- `ddp`: torch DistributedDataParallel over the dp group, around a thin module whose forward is the replay's
  `logprobs`. Replays 0..G-2 run under `no_sync()`, so their gradients accumulate in `.grad`; the last one
  runs synced and its backward all-reduces the accumulated sums, bucket by bucket, once per step.
  `find_unused_parameters=True`: a trainable parameter without a gradient (glm52's DSA indexer) is marked
  ready instead of stalling the reduction; the graph walk it costs runs in the synced replay only.
- `fsdp2`: `fully_shard` per decoder layer and on the root, over a 1-D mesh of the dp group. The model's entry
  points (capture, logprobs, start_decode, decode_step; a layer's named paths) are registered as forward
  methods so FSDP gathers around them. Replays 0..G-2 run with gradient sync off (gradients accumulate
  unsharded); the last backward reduce-scatters them once. Capture and rollout call the model a number of
  times that differs between ranks (prompt and response lengths), so `full_weights()` gathers the parameters
  once for them and no collective runs inside. Gradients and optimizer states are sharded DTensors.
- `deepspeed`: `deepspeed.initialize` with ZeRO stage 1 or 2 (`zero_stage`), gradient_accumulation_steps = G,
  its own clipping (`gradient_clipping` = max_grad_norm). The G backwards run inside the engine's
  `coalesce_grad_reduction()`, which keeps gradients local and reduces them in one pass when it closes, in
  `finalize` (plain ZeRO-2 would reduce-scatter in every backward). DeepSpeed computes the norm, clips and
  steps in one call, so `finalize` takes the step and `step` has nothing left to do.

Context parallel: the ranks of one CP group hold identical gradients already (replay all-reduces dq inside
attention), so strategies reduce over the dp group only; world = dp x cp, cp-fastest (ParallelDims). The CP
group is DeepSpeed's model-parallel group, so its norm counts each parameter once.

Checkpoints do not depend on the strategy: `state_dict()` gives the trainable weights by name and the
optimizer state in torch's layout with whole tensors, as one process holds them; `load_state_dict` takes the
same. Under fsdp2 and deepspeed both are collectives: every rank calls them.

Simplifications: fsdp2 needs every rank to produce gradients for the same parameters (no data-dependent
unused parameters); under fsdp2 the replay's graph memory includes the gathered weights autograd keeps for a
layer's backward; deepspeed keeps fp32 master weights and fp32 optimizer states (no fp64).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from longstraw_cli.models.core import LAYER_PATHS

STRATEGIES = ("ddp", "fsdp2", "deepspeed")
# ZeRO-3 is not supported: see deepspeed_zero.py
ZERO_STAGES = (1, 2)
# the model contract's entry points that read weights outside forward(); a decoder layer's named paths
MODEL_METHODS = ("capture", "logprobs", "start_decode", "decode_step")
LAYER_METHODS = LAYER_PATHS

MakeOptimizer = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class StrategyConfig:
    name: str = "ddp"
    # deepspeed: 1 partitions optimizer states, 2 also gradients
    zero_stage: int = 2

    def __post_init__(self):
        if self.name not in STRATEGIES:
            raise ValueError(f"name={self.name!r}; valid: {list(STRATEGIES)}")
        if self.zero_stage not in ZERO_STAGES or isinstance(self.zero_stage, bool):
            raise ValueError(f"zero_stage={self.zero_stage!r}; valid: {list(ZERO_STAGES)}")


class LocalStrategy:
    """One data-parallel rank: gradients accumulate over the replays and are final as they are."""

    name = "local"

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float | None):
        self.model, self.optimizer = model, optimizer
        self.max_grad_norm = float("inf") if max_grad_norm is None else max_grad_norm
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        # expert parallel: parameters of which this rank holds one slice, and the group holding the others
        self.sliced, self.slice_group = set(), None

    def set_expert_slices(self, params, group) -> None:
        """Count `params` (this rank's slices of tensors split over `group`) once each in the grad norm."""
        self.sliced, self.slice_group = {id(p) for p in params}, group

    def weights(self) -> list[torch.Tensor]:
        """This rank's weight tensors: memory accounted as weights, not as graph."""
        return list(self.model.parameters())

    # -- one optimizer step -----------------------------------------------------------------------------------
    def full_weights(self) -> contextlib.AbstractContextManager:
        """Around graph-free use of the policy (capture, rollout, scoring): whole weights on every rank."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def replay(self, index: int, count: int) -> Iterator[Callable[..., torch.Tensor]]:
        """Replay `index` of `count`: yields logprobs(resident, ids, chunk_size=...) with autograd."""
        yield functools.partial(self.model.logprobs, grad=True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def finalize(self) -> float:
        """Gradients final (reduced) on every rank and clipped; returns the global norm before clipping."""
        if self.slice_group is None:
            return float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm))
        whole = [p.grad for p in self.params if p.grad is not None and id(p) not in self.sliced]
        sliced = [p.grad for p in self.params if p.grad is not None and id(p) in self.sliced]
        sq = torch.stack([torch.nn.utils.get_total_norm(g) ** 2 if g else torch.zeros((), device=self.params[0].device)
                          for g in (whole, sliced)])
        # the slices' squared norms add up over the group; the replicated parameters count once
        dist.all_reduce(sq[1:], group=self.slice_group)
        norm = sq.sum().sqrt()
        torch.nn.utils.clip_grads_with_norm_(self.params, self.max_grad_norm, norm)
        return float(norm)

    def step(self) -> None:
        self.optimizer.step()
        self.zero_grad()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    # -- checkpoints ------------------------------------------------------------------------------------------
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(trainable weights by name, optimizer state): whole tensors, torch's layout."""
        return _trainable(self.model), self.optimizer.state_dict()

    def load_state_dict(self, model_state: dict[str, torch.Tensor], optimizer_state: dict) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in model_state.items():
                params[name].copy_(tensor)
        self.optimizer.load_state_dict(optimizer_state)


def _trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


class _Replay(nn.Module):
    """The replay as a module's forward, for wrappers that act in forward (DDP, the DeepSpeed engine)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, resident, response_ids: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
        return self.model.logprobs(resident, response_ids, grad=True, chunk_size=chunk_size)


class DDPStrategy(LocalStrategy):
    name = "ddp"

    def __init__(self, model: nn.Module, make_optimizer: MakeOptimizer, max_grad_norm: float | None, dp_group):
        from torch.nn.parallel import DistributedDataParallel

        # device_ids=None: inputs stay where they are (DDP would rebuild the Resident to move it)
        self.ddp = DistributedDataParallel(_Replay(model), process_group=dp_group, find_unused_parameters=True)
        super().__init__(model, make_optimizer([p for p in model.parameters() if p.requires_grad]), max_grad_norm)

    @contextlib.contextmanager
    def replay(self, index: int, count: int):
        sync = contextlib.nullcontext() if index == count - 1 else self.ddp.no_sync()
        with sync:
            yield self.ddp


class FSDP2Strategy(LocalStrategy):
    name = "fsdp2"

    def __init__(self, model: nn.Module, make_optimizer: MakeOptimizer, max_grad_norm: float | None, dp_group):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        device = next(model.parameters()).device
        mesh = DeviceMesh.from_group(dp_group, device.type)
        self.fsdp_modules = []
        for layer in model.model.layers:
            self.fsdp_modules.append(fully_shard(layer, mesh=mesh))
            for method in LAYER_METHODS:
                register_fsdp_forward_method(layer, method)
        self.fsdp_modules.append(fully_shard(model, mesh=mesh))
        for method in MODEL_METHODS:
            register_fsdp_forward_method(model, method)
        # parameters are DTensors from here on: the optimizer is built over them
        super().__init__(model, make_optimizer([p for p in model.parameters() if p.requires_grad]), max_grad_norm)

    def weights(self):
        return [p.to_local() for p in self.model.parameters()]

    @contextlib.contextmanager
    def full_weights(self):
        self.model.set_reshard_after_forward(False)
        for module in self.fsdp_modules:
            module.unshard()
        try:
            yield
        finally:
            self.model.set_reshard_after_forward(True)
            for module in self.fsdp_modules:
                module.reshard()

    @contextlib.contextmanager
    def replay(self, index: int, count: int):
        self.model.set_requires_gradient_sync(index == count - 1)
        try:
            yield functools.partial(self.model.logprobs, grad=True)
        finally:
            self.model.set_requires_gradient_sync(True)

    def finalize(self) -> float:
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(self.params, self.max_grad_norm, norm)
        return float(norm)

    def state_dict(self):
        optimizer_state = self.optimizer.state_dict()
        optimizer_state["state"] = {i: {k: _full(v) for k, v in s.items()} for i, s in optimizer_state["state"].items()}
        return {n: _full(p) for n, p in _trainable(self.model).items()}, optimizer_state

    def load_state_dict(self, model_state, optimizer_state):
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in model_state.items():
                params[name].copy_(_shard_like(tensor, params[name]))
        # state keys are positions in the optimizer's parameter list, as in torch's own layout
        by_index = [p for group in self.optimizer.param_groups for p in group["params"]]
        state = {i: {k: _shard_like(v, by_index[int(i)]) if k != "step" else v for k, v in s.items()}
                 for i, s in optimizer_state["state"].items()}
        self.optimizer.load_state_dict({**optimizer_state, "state": state})


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def _shard_like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a whole tensor, placed as `param` is (no communication: every rank holds it)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor):
        return full
    return distribute_tensor(full.to(param.device, param.dtype), param.device_mesh, param.placements,
                             src_data_rank=None)


def make_strategy(cfg: StrategyConfig, model: nn.Module, make_optimizer: MakeOptimizer, *,
                  max_grad_norm: float | None, num_replays: int, dp_group=None, cp_group=None) -> LocalStrategy:
    """The strategy `cfg` names, over the data-parallel group `dp_group` (None or one rank: `local`)."""
    if dp_group is None or dist.get_world_size(dp_group) == 1:
        return LocalStrategy(model, make_optimizer([p for p in model.parameters() if p.requires_grad]),
                             max_grad_norm)
    if cfg.name == "ddp":
        return DDPStrategy(model, make_optimizer, max_grad_norm, dp_group)
    if cfg.name == "fsdp2":
        return FSDP2Strategy(model, make_optimizer, max_grad_norm, dp_group)
    from longstraw_cli.distributed.deepspeed_zero import DeepSpeedStrategy

    return DeepSpeedStrategy(model, make_optimizer, max_grad_norm, dp_group, cp_group, zero_stage=cfg.zero_stage,
                             num_replays=num_replays)
