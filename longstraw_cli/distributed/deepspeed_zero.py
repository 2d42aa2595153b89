"""The `deepspeed` strategy: DeepSpeed ZeRO over the data-parallel group (contract: local_strategy.py; registered
by name in strategy.py).

DeepSpeed is optional (`pip install deepspeed`, or the `deepspeed` extra) and imported only here. On CPU it uses
its CPU accelerator with gloo (DS_ACCELERATOR=cpu, set here when unset; no oneCCL or compiled ops needed).

One optimizer step: the G replays' backwards run inside the engine's `coalesce_grad_reduction()`, which leaves
their gradients on the parameters; closing it in `finalize` makes one reduction pass (ZeRO-1: all-reduce,
ZeRO-2/3: reduce-scatter into this rank's partition), then the engine's step computes the global norm, clips to
`gradient_clipping` and steps. The loss is not divided by gradient_accumulation_steps: each replay's loss is
already its share of the group's loss. The accumulation boundary is pinned on, so every engine step is a step.

Simplifications: DeepSpeed keeps fp32 master weights and fp32 optimizer states whatever the model's dtype. No
ZeRO-3: it gathers a module's own parameters around its forward(), and the model reads some weights outside one
(lm_head.weight in the log-prob chunks, a GDN layer's conv1d weight); each would have to be registered as an
external parameter, and the graph-free phases would need the whole model gathered.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from torch import nn

from longstraw_cli.distributed.local_strategy import LocalStrategy, MakeOptimizer, Replay


def import_deepspeed():
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        import deepspeed
    except ImportError as e:
        raise ImportError(f"strategy=deepspeed needs DeepSpeed: pip install deepspeed (or the project's "
                          f"`deepspeed` extra: pip install 'longstraw[deepspeed]'); import failed: {e}") from None
    if not hasattr(deepspeed.DeepSpeedEngine, "coalesce_grad_reduction"):
        raise ImportError(f"strategy=deepspeed needs DeepSpeed >= 0.19.8 (engine.coalesce_grad_reduction), found "
                          f"{deepspeed.__version__}: pip install -U deepspeed")
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        # on CPU, DeepSpeed's communication set-up JIT-compiles a shared-memory all-reduce (3-4 minutes on two
        # cores) that serves inference only; marking it unavailable skips that, and the probe of every other op
        compatible = vars(deepspeed.ops).setdefault("__compatible_ops__", {})
        compatible["deepspeed_shm_comm"] = False
    return deepspeed


class _ModelParallel:
    """DeepSpeed's "mpu": data parallel over the dp group; the context-parallel group is the model-parallel
    axis, whose ranks hold identical gradients (DeepSpeed then counts each parameter once in the norm)."""

    def __init__(self, dp_group, cp_group):
        self.dp_group, self.cp_group = dp_group, cp_group

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_rank(self):
        return dist.get_rank(self.dp_group)

    def get_data_parallel_world_size(self):
        return dist.get_world_size(self.dp_group)

    def get_model_parallel_group(self):
        return self.cp_group

    def get_model_parallel_rank(self):
        return dist.get_rank(self.cp_group)

    def get_model_parallel_world_size(self):
        return dist.get_world_size(self.cp_group)


class DeepSpeedStrategy(LocalStrategy):
    name = "deepspeed"
    # ZeRO's hooks manage the parameters around each module call: no CUDA graph
    cuda_graphs = False
    # the engine reduces inside the last replay's backward; none follows a later walk
    exact_gradients = False

    def __init__(self, model: nn.Module, make_optimizer: MakeOptimizer, max_grad_norm: float | None, dp_group,
                 cp_group=None, *, zero_stage: int, num_replays: int):
        deepspeed = import_deepspeed()
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = make_optimizer(trainable)
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": num_replays,
            "gradient_clipping": 0.0 if max_grad_norm is None else max_grad_norm,
            "zero_optimization": {"stage": zero_stage},
            # a torch optimizer under ZeRO: DeepSpeed tests only its own
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": next(model.parameters()).dtype == torch.bfloat16},
            "steps_per_print": 2**62,
        }
        cp_world = 1 if cp_group is None else dist.get_world_size(cp_group)
        mpu = _ModelParallel(dp_group, cp_group) if cp_world > 1 else None
        self.engine, *_ = deepspeed.initialize(model=Replay(model), optimizer=optimizer, config=config, mpu=mpu,
                                               dist_init_required=False)
        self.engine.set_gradient_accumulation_boundary(True)
        self._coalesced = contextlib.ExitStack()
        super().__init__(model, optimizer, max_grad_norm)
        # ZeRO replaced the optimizer's parameters by its flat fp32 partitions: the model's are these
        self.params = trainable

    @contextlib.contextmanager
    def replay(self, index: int, count: int):
        if index == 0:
            self._coalesced.enter_context(self.engine.coalesce_grad_reduction())
        yield self.engine

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def finalize(self) -> float:
        """The one reduction (closing the coalesced backwards), then DeepSpeed's norm, clip and step together."""
        self._coalesced.close()
        self.engine.step()
        return float(self.engine.get_global_grad_norm())

    def step(self) -> None:
        """Taken by `finalize`: DeepSpeed clips inside its optimizer step."""

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    # -- checkpoints: whole tensors in torch's layout, assembled from ZeRO's partitions (collectives) ----------
    def _local_state_dict(self):
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        model_state = {}
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                model_state[name] = safe_get_full_fp32_param(p).to(p.dtype)
        # ZeRO's torch optimizer holds one flat fp32 partition per parameter group (one group here)
        inner = self.engine.optimizer.optimizer
        steps = [s["step"] for s in inner.state.values() if "step" in s]
        state = {}
        if steps:  # before the first step torch's AdamW has no state either
            state = {i: {"step": steps[0].clone(),
                         "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").to(p.dtype),
                         "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").to(p.dtype)}
                     for i, p in enumerate(self.params)}
        group = {k: v for k, v in inner.param_groups[0].items() if k != "params"}
        return model_state, {"state": state, "param_groups": [{**group, "params": list(range(len(self.params)))}]}

    def _load_local_state_dict(self, model_state, optimizer_state):
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        zero = self.engine.optimizer
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in model_state.items():
                # ZeRO-1/2 keep the whole model weights on every rank, and the fp32 master copy partitioned
                params[name].copy_(tensor)
                safe_set_full_fp32_param(params[name], tensor.float())
        state = optimizer_state["state"]
        if not state:
            return
        # torch's AdamW creates its state at the first step; ZeRO's lives on the flat fp32 partitions
        step = state[next(iter(state))]["step"]
        for flat in (p for group in zero.optimizer.param_groups for p in group["params"]):
            zero.optimizer.state[flat] = {"step": step.clone().float(), "exp_avg": torch.zeros_like(flat),
                                          "exp_avg_sq": torch.zeros_like(flat)}
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()
        for i, p in enumerate(self.params):
            for key in ("exp_avg", "exp_avg_sq"):
                safe_set_full_optimizer_state(p, state[i][key].float(), key)
