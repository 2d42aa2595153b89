import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# With triton importable, transformers' Qwen3.5 code binds fla and crashes on CPU; keep fla out of CPU tests
# (on a GPU machine fla's forward is one of the paths under test).
if not torch.cuda.is_available():
    sys.modules.setdefault("fla", None)
    # our Triton kernels run in Triton's interpreter on CPU (set before any kernel module is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# tqdm (datasets, hub) starts a monitor thread that takes its lock every few seconds; run_ranks forks this
# process, and a lock held by a thread at the fork stays held in the child: keep the process single-threaded
with contextlib.suppress(ImportError):
    import tqdm

    tqdm.tqdm.monitor_interval = 0

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def default_kernels():
    """Each test starts on the default kernel choices, and what it (or a Trainer it builds) puts in force ends with
    it: `use_kernels(op="torch")` in a test needs no undoing."""
    from longstraw_kernels import KernelConfig, use_kernels

    with use_kernels(KernelConfig()):
        yield


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """RMS-relative error ||a - b|| / ||b||; fails on NaN/inf and on an all-zero reference."""
    a, b = a.detach().double(), b.detach().double()
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.isfinite(a).all() and torch.isfinite(b).all(), "non-finite values"
    ref = b.norm()
    assert ref > 0, "reference is all zeros: the comparison would prove nothing"
    return ((a - b).norm() / ref).item()

def worst_rel_err(got: dict, ref: dict) -> float:
    """The worst relative error over the parameters of two gradient dicts with the same names."""
    assert got.keys() == ref.keys()
    return max(rel_err(got[n], ref[n]) for n in ref)


EXPERT_PARAMS = ("experts.gate_up_proj", "experts.down_proj")


def worst_rank_err(got: dict, ref: dict, rank: int, ep: int) -> tuple[float, str]:
    """A rank's worst relative error against one rank's gradients (an expert's, under EP: this rank's slice of one
    rank's) -> (error, parameter name). An expert slice that received no token has zero gradient on one rank too."""
    from longstraw_cli.distributed.ep import expert_bounds

    assert got.keys() == ref.keys()
    errs = {}
    for n, g in ref.items():
        if ep > 1 and n.endswith(EXPERT_PARAMS):
            g = g[slice(*expert_bounds(g.shape[0], ep, rank % ep))]
        errs[n] = rel_err(got[n], g) if g.norm() > 0 else float(got[n].norm())
    return max(errs.values()), max(errs, key=errs.get)



def gdn_inputs(B, T, H, G, K, V, with_state=True, seed=0) -> dict:
    """Random fp64 CPU inputs of the gated delta rule: q, k unit-norm; log-decay g in about (-3, 0); beta in
    (0, 1); a random initial state (None without one)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    return {
        "q": torch.nn.functional.normalize(randn(B, T, H, K), dim=-1),
        "k": torch.nn.functional.normalize(randn(B, T, H, K), dim=-1),
        "v": randn(B, T, G, V),
        "g": -torch.nn.functional.softplus(randn(B, T, G)),
        "beta": torch.sigmoid(randn(B, T, G)),
        "state": randn(B, G, K, V) * 0.5 if with_state else None,
    }


def free_ports(n: int) -> list[int]:
    """n different free TCP ports on localhost, one per gloo rendezvous: all n are held open while the kernel picks,
    so none repeats. Runs one after another in the same processes need different ports: a rank that finishes a run
    first and opens the next on the same port meets the store of the run a slower rank is still in, and hangs."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def free_port() -> int:
    """A free TCP port on localhost for a gloo rendezvous."""
    return free_ports(1)[0]


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add synchronisation, which stalls badly on a busy 2-core machine."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter random, norms included: zeros or ones would hide a (1 + w) versus w mix-up."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.01, 4, generator=g).log())
            elif "norm" in name:
                p.copy_(0.5 * torch.rand(p.shape, generator=g) + (0.75 if "linear_attn.norm" in name else -0.25))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.08)


def random_model(name: str, dtype=torch.float64, seed: int = 0, **overrides) -> torch.nn.Module:
    """A named tiny model with every parameter random; keyword overrides replace config fields (build_model's).
    qwen36: randomize_. glm52: the router bias random too, large enough to change which experts are chosen."""
    # imported here: the environment above must be set before any kernel module is imported
    from longstraw_cli.models import build_model

    model = build_model(name, dtype=dtype, **overrides)
    if not name.startswith("glm52"):
        randomize_(model, seed)
        return model
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            scale = 0.25 if "norm" in param_name else 0.1
            p.copy_((1.0 if "norm" in param_name else 0.0) + scale * torch.randn(p.shape, generator=g))
        for b in model.buffers():
            b.copy_(0.3 * torch.randn(b.shape, generator=g))
    return model


def ids(n: int, seed: int) -> torch.Tensor:
    """n random token ids below 259 (the byte tokenizer's vocabulary), seeded."""
    return torch.randint(0, 259, (n,), generator=torch.Generator().manual_seed(seed))


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def random_lora_(model: torch.nn.Module, targets: tuple[str, ...], seed: int = 5) -> None:
    """LoRA of rank 2 on `targets`, both factors random (fresh adapters are a no-op with a zero B)."""
    from longstraw_cli.lora import LoraConfig, apply_lora, lora_layers

    apply_lora(model, LoraConfig(rank=2, alpha=4.0, target_modules=targets))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_A.copy_(torch.randn(layer.lora_A.shape, generator=g, dtype=torch.float64) * 0.1)
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g, dtype=torch.float64) * 0.1)


def replay_grads(model, resident, responses) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Each response replayed against `resident` under autograd, response i's log-probs weighted by i + 1 (distinct
    weights: a gradient landing on the wrong response shows) -> (the log-probs, the parameter gradients)."""
    model.zero_grad(set_to_none=True)
    logps = []
    for i, response in enumerate(responses):
        logp = model.logprobs(resident, response, grad=True)
        ((i + 1.0) * logp).sum().backward()
        logps.append(logp.detach())
    out = grads(model)
    model.zero_grad(set_to_none=True)
    return logps, out


def response_only_grads(model, prompt, responses, weights, block_size) -> dict[str, torch.Tensor]:
    """The objective of `exact_grads` with the resident state a constant (response_only): the parameter gradients."""
    model.zero_grad(set_to_none=True)
    resident = model.capture(prompt, block_size=block_size)
    for response, w in zip(responses, weights):
        (w * model.logprobs(resident, response, grad=True)).sum().backward()
    out = grads(model)
    model.zero_grad(set_to_none=True)
    return out


def exact_grads(model, prompt, responses, weights, block_size, tamper=None,
                checkpoint_layers=False) -> dict[str, torch.Tensor]:
    """capture.gradient=exact by hand: the capture with boundaries, sum_i <weights_i, log p(response_i)> replayed
    against a leaf view of the resident state, then the reverse walk; -> the parameter gradients.
    `tamper(state_grad, resident)` runs between the two (a control)."""
    from longstraw_cli.resident.gradient import StateGrad

    model.zero_grad(set_to_none=True)
    resident = model.capture(prompt, block_size=block_size, boundaries=True)
    state_grad = StateGrad(resident)
    view = state_grad.replay_view(resident)
    for response, w in zip(responses, weights):
        (w * model.logprobs(view, response, grad=True)).sum().backward()
    if tamper is not None:
        tamper(state_grad, resident)
    model.prompt_backward(prompt, resident, state_grad, block_size, checkpoint_layers)
    out = grads(model)
    model.zero_grad(set_to_none=True)
    return out


def run_ranks(worker, world_size, *args, timeout_s=120):
    """Runs worker(rank, world_size, port, *args) on world_size processes and waits, failing after timeout_s.

    Forked, not spawned: spawn re-imports torch in every child (15-35 s for 2-4 ranks on the loaded 2-core test
    machine, against 1 s). Safe because the worker sets one intra-op thread before any torch op: libgomp's thread
    pool does not survive a fork, and a forked child entering a parallel region with more threads hangs; and because
    the suite keeps this process to its one thread (tqdm's monitor off, above). The deadline turns any hang into a
    failure.
    """
    ctx = mp.start_processes(worker, args=(world_size, free_port(), *args), nprocs=world_size, join=False,
                             start_method="fork")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for process in ctx.processes:
                process.kill()
            pytest.fail(f"{world_size} ranks did not finish within {timeout_s} s")


def join_gloo(rank: int, world_size: int, port: int) -> dict:
    """A forked rank's first step: one intra-op thread (the parent's OpenMP pool is gone in the child, see
    run_ranks), the gloo group, and the subgroups of two ranks, which every rank must create (a collective).
    -> {2: this rank's pair} when world_size > 2, else {}: a case sharded over 2 ranks runs in its pair."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    return {2: dist.new_subgroups(group_size=2)[0]} if world_size > 2 else {}


def rank_results(worker, world_size: int, out_dir, timeout_s: int = 120) -> list:
    """[rank -> what worker(rank, world_size, port, out_dir) saved as out_dir/rank{r}.pt], after run_ranks."""
    run_ranks(worker, world_size, str(out_dir), timeout_s=timeout_s)
    return [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(world_size)]


def cached_rank_results(tmp_path_factory, worker, name: str):
    """world size -> `rank_results`, running each world size once per module."""
    cache = {}

    def get(world_size):
        if world_size not in cache:
            cache[world_size] = rank_results(worker, world_size, tmp_path_factory.mktemp(f"{name}{world_size}"))
        return cache[world_size]

    return get


def saved_hf_model(tmp_path_factory, config_cls, model_cls, config: dict, randomize) -> tuple:
    """An HF model of `config`, every weight random (`randomize`), saved as a checkpoint directory. -> (path,
    model): the oracle and what from_pretrained reads."""
    torch.manual_seed(0)
    model = model_cls(config_cls(**config)).eval()
    randomize(model)
    path = tmp_path_factory.mktemp(model_cls.__name__)
    model.save_pretrained(path)
    return path, model


def capture_error_against_hf(hf, ours, prompt_len: int, response_len: int, block_size: int) -> float:
    """Max abs error of our capture + logprobs against HF's full-sequence log-softmax, seeded random ids."""
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 300, (prompt_len,), generator=g)
    response = torch.randint(0, 300, (response_len,), generator=g)
    with torch.no_grad():
        logits = hf(torch.cat([prompt, response])[None]).logits[0].float()
    ref = torch.log_softmax(logits, -1)[prompt.numel() - 1 : -1].gather(-1, response[:, None])[:, 0]
    got = ours.logprobs(ours.capture(prompt, block_size=block_size), response)
    return (got - ref).abs().max().item()


CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def chat_model_dir(path):
    """An HF directory of qwen36_tiny (random weights) and a tiny byte-level tokenizer built here with the
    `tokenizers` library: ids 0..255 are bytes, then <|endoftext|> (EOS), <|im_start|>, <|im_end|> (259 ids, the
    model's vocabulary), and a ChatML template. No generation_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from longstraw_cli.export import _bytes_to_unicode, export_hf
    from longstraw_cli.models import build_model

    export_hf(build_model("qwen36_tiny", seed=0), path)
    rust = Tokenizer(models.BPE(vocab={c: b for b, c in _bytes_to_unicode().items()}, merges=[]))
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    rust.decoder = decoders.ByteLevel()
    rust.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    hf = PreTrainedTokenizerFast(tokenizer_object=rust, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    hf.chat_template = CHATML
    hf.save_pretrained(path)
    return path


def longstraw(args, cwd, env=None, timeout=900):
    """`longstraw train ARGS` in a child process (python -m longstraw_cli)."""
    return subprocess.run([sys.executable, "-m", "longstraw_cli", "train", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def torchrun(args, cwd, nproc=2) -> subprocess.CompletedProcess:
    """`longstraw train ARGS` on nproc gloo ranks under torchrun, in child processes; tests/e2e on the path:
    rewards_for_tests is importable as a reward spec."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent / "e2e"),
                                                                     os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), "-m", "longstraw_cli", "train", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=900, env=env)


@pytest.fixture(scope="session")
def torchrun_once(tmp_path_factory):
    """`torchrun_once(ARGS)` -> the run dir of `longstraw train ARGS` on 2 ranks under torchrun (which must
    succeed), launched once per pytest run for each ARGS: tests that compare with the same run share its launch."""
    done = {}

    def run(args: list[str]) -> Path:
        if tuple(args) not in done:
            run_dir = tmp_path_factory.mktemp("torchrun") / "run"
            out = torchrun([*args, f"run_dir={run_dir}"], cwd=run_dir.parent)
            assert out.returncode == 0, out.stderr[-2000:]
            done[tuple(args)] = run_dir
        return done[tuple(args)]

    return run


@pytest.fixture(scope="session")
def glm52_ep_runs(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """glm52_tiny trained under torchrun at cp=2 in fp64, with a KL reference and a reward that varies within each
    group: 4 steps at ep=2 ("whole", exported), 2 steps at ep=2 ("ep2"), and that checkpoint resumed to step 4 at
    ep=2 ("ep2") and at ep=1 ("ep1", a copy, exported). -> (their parent dir, each launch's stderr by name).
    tests/e2e/test_cli.py checks the resumes, tests/e2e/test_export_cli.py the exports: a launch costs ~9 s of
    start-up on two cores, so the two tests share these four."""
    import shutil

    runs = tmp_path_factory.mktemp("glm52_ep")
    args = ["model=glm52_tiny", "prompt_tokens=128", "response_tokens=8", "group_size=4", "model.dtype=float64",
            "logger.backends=[jsonl]", "cp=2", "algo.kl_coef=0.5", "task.reward=rewards_for_tests:response_length"]
    stderr = {}

    def train(name, *run_args):
        out = torchrun([*args, *run_args, f"run_dir={runs / name}"], cwd=runs)
        assert out.returncode == 0, out.stderr[-2000:]
        stderr[name] = out.stderr

    train("whole", "steps=4", "ep=2", "export_hf=true")
    train("ep2", "steps=2", "ep=2")
    shutil.copytree(runs / "ep2", runs / "ep1")
    train("ep2", "steps=4", "ep=2", "resume=true")
    train("ep1", "steps=4", "ep=1", "resume=true", "export_hf=true")
    return runs, stderr


@pytest.fixture
def train_here(tmp_path, monkeypatch, capsys):
    """`longstraw train ARGS` in this process, in tmp_path: -> (exit code, stdout, stderr). Hydra sets sys.argv,
    the root logger's handlers (its log file, a console on the captured stdout) and its global state; all are put
    back afterwards."""
    from hydra.core.global_hydra import GlobalHydra

    from longstraw_cli.__main__ import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level

    def run(args):
        capsys.readouterr()
        try:
            code = main(["train", *args])
        except SystemExit as e:
            code = e.code
        out = capsys.readouterr()
        return code, out.out, out.err

    yield run
    for handler in root.handlers:
        if handler not in handlers:
            handler.close()
    root.handlers[:] = handlers
    root.setLevel(level)
    GlobalHydra.instance().clear()


def rows(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    """The metrics.jsonl (or `name`: samples.jsonl) rows of a run."""
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def composed(overrides: list[str]) -> dict:
    """The resolved config that `longstraw train OVERRIDES` would compose (what `train_config` takes)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from longstraw_cli.cli import CONF_DIR

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return OmegaConf.to_container(compose("config", overrides=overrides), resolve=True)


def randomize_glm_(model, seed=0):
    """Every parameter and the router bias random. The indexer's head weights are kept positive: index scores
    are then >= 0 with exact ties only at 0, far below the k-th best, so HF's unspecified tie order cannot
    change the selection (tests/models/test_glm52_hf_parity.py's TopkGuard asserts it)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.5 * torch.rand(p.shape, generator=g) + 0.75)
            elif "weights_proj" in name:
                p.copy_(torch.rand(p.shape, generator=g) * 0.3 + 0.05)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.08)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                # of the order of the sigmoid scores themselves: the bias changes which experts are chosen
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    return model


def tie_free_glm(dtype=torch.float32, seed: int = 0) -> torch.nn.Module:
    """glm52_tiny with 8 index heads (its 4 leave exact ties at the top-k boundary on long prompts, where HF's tie
    order is unspecified), every weight random (`randomize_glm_`): what our logits are compared with transformers'
    on."""
    from longstraw_cli.models import build_model

    return randomize_glm_(build_model("glm52_tiny", dtype=dtype, index_n_heads=8), seed).eval()


@pytest.fixture
def fresh_dynamo():
    """dynamo's compiled graphs dropped before and after the test (its counts and recompile limits start at 0)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def assert_compiled_step_equals_eager(eager_decoder, compiled_decoder, steps: int = 3, first=(5, 77)) -> None:
    """A decoder's step compiled (`aot_eager`: dynamo and AOTAutograd's functionalization, the compiled decode
    step's path) gives the same logits as another decoder of the same prompt stepped eagerly, fed the same tokens,
    without gradients (as the rollout decodes)."""
    step = compiled_decoder.compiled(backend="aot_eager")
    for decoder in (eager_decoder, compiled_decoder):
        decoder.tokens_B.copy_(torch.tensor(first))
    with torch.no_grad():
        for _ in range(steps):
            want = eager_decoder.step()
            assert torch.equal(step(), want)
            for decoder in (eager_decoder, compiled_decoder):
                decoder.tokens_B.copy_(want.argmax(-1))


def assert_decodes_alike(want_decoder, got_decoder, steps: int, bound: float, first=(5, 77)) -> None:
    """Two decoders of one prompt fed the same tokens (`first`, then the first decoder's greedy choice) give logits
    within `bound` (rel_err) at each of `steps` steps."""
    for decoder in (want_decoder, got_decoder):
        decoder.tokens_B.copy_(torch.tensor(first))
    for _ in range(steps):
        want, got = want_decoder.step(), got_decoder.step()
        assert rel_err(got.double(), want.double()) < bound
        for decoder in (want_decoder, got_decoder):
            decoder.tokens_B.copy_(want.argmax(-1))


def checked_task(cfg, tokenizer):
    """`make_task(cfg, tokenizer)` with the examples it checks at start drawn, as the trainer draws them before any
    work (a file's bad row raises here)."""
    from longstraw_cli.rl.tasks import make_task

    task = make_task(cfg, tokenizer)
    for _ in task.examples_checked_at_start():
        pass
    return task
