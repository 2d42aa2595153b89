"""The strategy contract and its one-rank form, `LocalStrategy`, which every other strategy extends (ddp and fsdp2
in strategy.py, deepspeed in deepspeed_zero.py; `make_strategy` there picks one by name).

A strategy owns what happens to gradients and weights across ranks: the replay's forward/backward, gradient
finalization (the one reduction per step, clipping to `max_grad_norm`, the global norm), the optimizer step, and
the state dicts checkpoints are made of. Expert parallelism is part of it: given the EP group, the grad norm counts
each expert slice once, and checkpoints are sharded (`sharded_state_dict`, written by
checkpoint/format_sharded.py through torch.distributed.checkpoint): each expert parameter and its AdamW moments
are this rank's rows of the whole [E, ...] tensor (a DTensor over the EP group, at the rows' global offset), so a
rank writes and reads only its own experts, the replicated tensors are written once, and a checkpoint resumes
under any ep. `state_dict()` (whole tensors, the expert slices gathered on every rank) is what one process holds;
`load_state_dict()` takes it, e.g. from a whole-tensor checkpoint written at ep=1, and keeps this rank's slice.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from longstraw_cli.distributed.ep import ep_shard, gather_rows, is_expert_param

MakeOptimizer = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class LocalStrategy:
    """One data-parallel rank: gradients accumulate over the replays and are final as they are. `ep_group`: the
    group over which the model's routed experts are split (distributed/ep.py), None without expert parallelism."""

    name = "local"
    # the model's own modules run the decode step, so a CUDA graph may replay it
    cuda_graphs = True
    # exact mode's prompt walk may follow the replays: gradients stay local until `sync_gradients`
    exact_gradients = True

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float | None, *,
                 ep_group=None):
        self.model, self.optimizer = model, optimizer
        self.max_grad_norm = float("inf") if max_grad_norm is None else max_grad_norm
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        # expert parallel: parameters of which this rank holds one slice; ep_group holds the others
        self.ep_group = ep_group
        self.sliced = set() if ep_group is None else {id(p) for n, p in model.named_parameters() if is_expert_param(n)}
        self._ep_mesh = None

    @property
    def sharded_checkpoints(self) -> bool:
        """Whether this strategy's checkpoints are sharded through DCP (checkpoint/format_sharded.py) rather than
        whole tensors (checkpoint/format_whole.py): under ep, so that no rank gathers the experts it does not hold."""
        return self.ep_group is not None

    def weights(self) -> list[torch.Tensor]:
        """This rank's weight tensors: memory accounted as weights, not as graph."""
        return list(self.model.parameters())

    # -- one optimizer step -----------------------------------------------------------------------------------
    def full_weights(self) -> contextlib.AbstractContextManager:
        """Around graph-free use of the policy (capture, rollout, scoring): whole weights on every rank. May be
        nested: the outermost one gathers."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def replay(self, index: int, count: int) -> Iterator[Callable[..., torch.Tensor]]:
        """Replay `index` of `count`: yields logprobs(resident, ids, chunk_size=...) with autograd."""
        yield functools.partial(self.model.logprobs, grad=True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def sync_gradients(self) -> None:
        """After backward passes outside the replays (exact mode's prompt walk), all of whose replays ran unsynced:
        the reduction the last replay's backward would have done. Nothing to reduce on one rank."""

    def finalize(self) -> float:
        """Gradients final (reduced) on every rank and clipped; returns the global norm before clipping."""
        if self.ep_group is None:
            return float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm))
        whole = [p.grad for p in self.params if p.grad is not None and id(p) not in self.sliced]
        sliced = [p.grad for p in self.params if p.grad is not None and id(p) in self.sliced]
        sq = torch.stack([torch.nn.utils.get_total_norm(g) ** 2 if g else torch.zeros((), device=self.params[0].device)
                          for g in (whole, sliced)])
        # the slices' squared norms add up over the group; the replicated parameters count once
        dist.all_reduce(sq[1:], group=self.ep_group)
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
        """(trainable weights by name, optimizer state): whole tensors in torch's layout, as one process holds
        them, whatever the strategy and ep. A collective under fsdp2, deepspeed and ep: every rank calls it."""
        model_state, optimizer_state = self._local_state_dict()
        if self.ep_group is None:
            return model_state, optimizer_state
        return self._convert_experts(model_state, optimizer_state, lambda t: gather_rows(t, self.ep_group))

    def load_state_dict(self, model_state: dict[str, torch.Tensor], optimizer_state: dict) -> None:
        """Takes what `state_dict` gives (whole tensors); each rank keeps its shard and its expert slice."""
        if self.ep_group is not None:
            model_state, optimizer_state = self._convert_experts(model_state, optimizer_state,
                                                                 lambda t: ep_shard(t, self.ep_group))
        self._load_local_state_dict(model_state, optimizer_state)

    def sharded_model_state(self) -> dict:
        """This rank's trainable weights by name as DCP writes them: as it holds them (DTensor shards under fsdp2),
        each expert parameter under ep a DTensor of this rank's rows of the whole [E, ...] tensor."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        model_state, sliced = get_model_state_dict(self.model, options=_trainable_only()), self._sliced_names()
        return {n: self._rows_of_whole(t) if n in sliced else t for n, t in model_state.items()}

    def sharded_state_dict(self) -> dict:
        """{"model": weights by name, "optim": optimizer state by parameter name}, for DCP to write or to read into
        in place (`load_sharded_state_dict` then puts it back): the tensors this rank holds, the expert parameters
        and their AdamW moments as in `sharded_model_state` (wrapped, not copied)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=_trainable_only())
        sliced = self._sliced_names()
        model_state = {n: self._rows_of_whole(t) if n in sliced else t for n, t in model_state.items()}
        # AdamW's moments have the parameter's shape; its step counter is a scalar, the same on every rank
        optim_state["state"] = {n: {k: self._rows_of_whole(v) if torch.is_tensor(v) and v.dim() > 0 else v
                                    for k, v in s.items()} if n in sliced else s
                                for n, s in optim_state["state"].items()}
        return {"model": model_state, "optim": optim_state}

    def load_sharded_state_dict(self, state: dict) -> None:
        """Takes a `sharded_state_dict()` DCP has read into: the model and optimizer get its values."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
        from torch.distributed.tensor import DTensor

        # the expert DTensors wrap this rank's rows; fsdp2's own DTensors stay as they are
        def local(t):
            return t.to_local() if self.ep_group is not None and isinstance(t, DTensor) else t

        # not strict: a parameter that never had a gradient (glm52's DSA indexer) has no optimizer state to load;
        # the weights were checked against the checkpoint's (checkpoint/format_sharded.py)
        set_state_dict(self.model, self.optimizer, model_state_dict={n: local(t) for n, t in state["model"].items()},
                       optim_state_dict={**state["optim"], "state": {
                           n: {k: local(v) for k, v in s.items()} for n, s in state["optim"]["state"].items()}},
                       options=StateDictOptions(ignore_frozen_params=True, strict=False))

    def _sliced_names(self) -> set[str]:
        return {n for n, p in self.model.named_parameters() if id(p) in self.sliced and p.requires_grad}

    def _rows_of_whole(self, rows_L: torch.Tensor) -> torch.Tensor:
        """This rank's expert rows as a DTensor of the whole [E, ...] tensor, sharded by rows over the EP group:
        DCP then stores them at their global offset (expert index), and reads a rank under another ep the rows it
        holds. Wraps the tensor itself: no copy."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard

        if self._ep_mesh is None:
            self._ep_mesh = DeviceMesh.from_group(self.ep_group, rows_L.device.type)
        # the mesh orders ranks as the group does, so Shard(0) puts this rank's rows where `expert_bounds` says
        assert self._ep_mesh.get_local_rank() == dist.get_rank(self.ep_group)
        return DTensor.from_local(rows_L, self._ep_mesh, [Shard(0)], run_check=False)

    def _local_state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Whole tensors over the data-parallel ranks; expert parameters still this rank's slice."""
        return _trainable(self.model), self.optimizer.state_dict()

    def _load_local_state_dict(self, model_state: dict[str, torch.Tensor], optimizer_state: dict) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in model_state.items():
                params[name].copy_(tensor)
        self.optimizer.load_state_dict(optimizer_state)

    def _convert_experts(self, model_state: dict, optimizer_state: dict, convert: Callable):
        """`convert` applied to every expert parameter and to its optimizer state's tensors (not the scalar step):
        gathering slices into whole tensors, or slicing whole ones. Copies: the live optimizer state is never
        modified."""
        sliced = {n for n, p in self.model.named_parameters() if p.requires_grad and id(p) in self.sliced}
        model_state = {n: convert(t) if n in sliced else t for n, t in model_state.items()}
        # optimizer state keys are positions in the optimizer's parameter list, as in torch's own layout
        positions = {id(p): i for i, p in enumerate(self.params)}
        sliced_positions = {positions[id(p)] for n, p in self.model.named_parameters() if n in sliced}
        state = {i: ({k: convert(v) if torch.is_tensor(v) and v.dim() > 0 else v for k, v in s.items()}
                     if int(i) in sliced_positions else s) for i, s in optimizer_state["state"].items()}
        return model_state, {**optimizer_state, "state": state}


def _trainable_only():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True)


def _trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


class Replay(nn.Module):
    """The replay as a module's forward, for wrappers that act in forward (DDP, the DeepSpeed engine)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, resident, response_ids: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
        return self.model.logprobs(resident, response_ids, grad=True, chunk_size=chunk_size)
