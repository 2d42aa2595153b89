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
  Every strategy name runs as `local` when dp == 1. With expert parallelism (ep > 1: local or ddp) the grad
  norm adds the expert slices' squared norms over the EP group.
- `ddp`: torch DistributedDataParallel over the dp group, around a thin module whose forward is the replay's
  `logprobs`. Replays 0..G-2 run under `no_sync()`, so their gradients accumulate in `.grad`; the last one
  runs synced and its backward all-reduces the accumulated sums, bucket by bucket, once per step.
  `find_unused_parameters` only where a trainable parameter never gets a gradient (glm52's DSA indexer under full
  fine-tuning, `base_weights.NO_GRADIENT_SCOPES`): DDP then marks it ready instead of stalling the reduction (the graph
  walk it costs runs in the synced replay only); elsewhere DDP would warn on every rank that it found none.
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

Checkpoints (the checkpoint/ package writes, checks and selects them; a strategy only supplies state dicts):
`state_dict()` gives the trainable weights by name and the optimizer state in torch's layout with
whole tensors, as one process holds them (expert slices gathered over the EP group); `load_state_dict` takes
the same. fsdp2 and ep > 1 checkpoints are sharded instead (`sharded_checkpoints`, `sharded_state_dict`:
checkpoint/format_sharded.py, torch.distributed.checkpoint), and load under any world size and ep into fsdp2,
ddp or one process. Under fsdp2,
deepspeed and ep both are collectives: every rank calls them. The contract and the one-rank strategy live in
local_strategy.py; `make_strategy` picks a registered builder by name (deepspeed_zero.py is imported only when
its builder runs).

Simplifications: fsdp2 needs every rank to produce gradients for the same parameters (no data-dependent
unused parameters); under fsdp2 the replay's graph memory includes the gathered weights autograd keeps for a
layer's backward; deepspeed keeps fp32 master weights and fp32 optimizer states (no fp64).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from longstraw_cli.base_weights import NO_GRADIENT_SCOPES
from longstraw_cli.distributed.local_strategy import LocalStrategy, MakeOptimizer, Replay, _trainable
from longstraw_cli.distributed.topology import SINGLE_PROCESS, ProcessGroups
from longstraw_cli.models.core import LAYER_PATHS

__all__ = ["DDPStrategy", "FSDP2Strategy", "LocalStrategy", "StrategyConfig", "STRATEGIES", "make_strategy"]

# ZeRO-3 is not supported: see deepspeed_zero.py
ZERO_STAGES = (1, 2)
# the model contract's entry points that read weights outside forward(); a decoder layer's named paths
MODEL_METHODS = ("capture", "logprobs", "start_decode", "decode_step")
LAYER_METHODS = LAYER_PATHS


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


def never_differentiated(model: nn.Module) -> list[str]:
    """The trainable parameters that the loss never reaches (modules run without autograd)."""
    return [name for name, p in model.named_parameters()
            if p.requires_grad and set(name.split(".")) & set(NO_GRADIENT_SCOPES)]


class DDPStrategy(LocalStrategy):
    name = "ddp"

    def __init__(self, model: nn.Module, make_optimizer: MakeOptimizer, max_grad_norm: float | None, dp_group, *,
                 ep_group=None):
        from torch.nn.parallel import DistributedDataParallel

        # device_ids=None: inputs stay where they are (DDP would rebuild the Resident to move it)
        self.ddp = DistributedDataParallel(Replay(model), process_group=dp_group,
                                           find_unused_parameters=bool(never_differentiated(model)))
        super().__init__(model, make_optimizer([p for p in model.parameters() if p.requires_grad]), max_grad_norm,
                         ep_group=ep_group)

    @contextlib.contextmanager
    def replay(self, index: int, count: int):
        sync = contextlib.nullcontext() if index == count - 1 else self.ddp.no_sync()
        with sync:
            yield self.ddp

    def sync_gradients(self) -> None:
        """DDP's reduction by hand: the mean over the data-parallel ranks of every gradient. Parameters that got
        none here get a zero one first, so that every rank reduces the same list."""
        group = self.ddp.process_group
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.params]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        flat /= dist.get_world_size(group)
        for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)


class FSDP2Strategy(LocalStrategy):
    name = "fsdp2"
    # hooks gather the sharded weights around each module call: not something to replay as a CUDA graph
    cuda_graphs = False
    # the reduce-scatter runs inside the last replay's backward; none follows a later walk
    exact_gradients = False
    # each rank writes its own shards: no rank gathers a whole tensor
    sharded_checkpoints = True

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
        self._full_depth = 0

    def weights(self):
        return [p.to_local() for p in self.model.parameters()]

    @contextlib.contextmanager
    def full_weights(self):
        # nested (a capture inside the trainer's capture-and-rollout scope): the outermost one gathers
        self._full_depth += 1
        if self._full_depth == 1:
            self.model.set_reshard_after_forward(False)
            for module in self.fsdp_modules:
                module.unshard()
        try:
            yield
        finally:
            self._full_depth -= 1
            if self._full_depth == 0:
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

    def _local_state_dict(self):
        optimizer_state = self.optimizer.state_dict()
        optimizer_state["state"] = {i: {k: _full(v) for k, v in s.items()} for i, s in optimizer_state["state"].items()}
        return {n: _full(p) for n, p in _trainable(self.model).items()}, optimizer_state

    def _load_local_state_dict(self, model_state, optimizer_state):
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


# -- the registry: one small builder per strategy name ------------------------------------------------------------
def _ddp(cfg, model, make_optimizer, groups, max_grad_norm, num_replays) -> LocalStrategy:
    return DDPStrategy(model, make_optimizer, max_grad_norm, groups.dp, ep_group=groups.ep)


def _fsdp2(cfg, model, make_optimizer, groups, max_grad_norm, num_replays) -> LocalStrategy:
    return FSDP2Strategy(model, make_optimizer, max_grad_norm, groups.dp)


def _deepspeed(cfg, model, make_optimizer, groups, max_grad_norm, num_replays) -> LocalStrategy:
    from longstraw_cli.distributed.deepspeed_zero import DeepSpeedStrategy

    return DeepSpeedStrategy(model, make_optimizer, max_grad_norm, groups.dp, groups.cp, zero_stage=cfg.zero_stage,
                             num_replays=num_replays)


BUILDERS = {"ddp": _ddp, "fsdp2": _fsdp2, "deepspeed": _deepspeed}
STRATEGIES = tuple(BUILDERS)
# strategies whose finalize counts expert slices once in the grad norm
EXPERT_PARALLEL = ("ddp",)


def make_strategy(cfg: StrategyConfig, model: nn.Module, make_optimizer: MakeOptimizer,
                  groups: ProcessGroups = SINGLE_PROCESS, *, max_grad_norm: float | None,
                  num_replays: int) -> LocalStrategy:
    """The strategy `cfg` names over this rank's `groups` (ParallelDims.new_groups): it reduces over groups.dp
    (None or one rank: `local`) and gathers expert slices over groups.ep (None: no expert parallelism)."""
    if groups.dp is None or dist.get_world_size(groups.dp) == 1:
        return LocalStrategy(model, make_optimizer([p for p in model.parameters() if p.requires_grad]),
                             max_grad_norm, ep_group=groups.ep)
    if groups.ep is not None and cfg.name not in EXPERT_PARALLEL:
        raise ValueError(f"strategy={cfg.name!r} does not know expert slices; with ep > 1 valid: "
                         f"{list(EXPERT_PARALLEL)}")
    return BUILDERS[cfg.name](cfg, model, make_optimizer, groups, max_grad_norm, num_replays)
