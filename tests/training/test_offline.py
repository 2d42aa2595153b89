"""Responses from data (rollout=data) and without a decode (rollout=synthetic), rollout/given.py and data.py:

- offline GRPO equals on-policy GRPO given the same responses: the native rollout's responses (and rewards, and
  old log-probs) written to a file and trained on from it give the on-policy run's losses and weights, fp64, both
  families; old log-probs left out are scored from the resident state;
- rows with one prompt merge into one group; text responses are the chat template's continuation of the prompt,
  cut at the first stop token, or plain text with EOS; token ids are used as given;
- synthetic responses are group_size x response_tokens seeded random ids with random rewards;
- what does not go together is refused in one line."""

import json
from pathlib import Path

import pytest
import torch

from conftest import CHATML, checked_task, composed, rows
from longstraw_cli.config import ConfigError, train_config
from longstraw_cli.rl.tasks import TaskConfig
from longstraw_cli.rollout.given import DataResponses, SyntheticResponses
from longstraw_cli.safety.inputs import InputError
from longstraw_cli.tokenizer import ByteTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

E2E = Path(__file__).parents[1] / "e2e"
PROMPTS = [{"prompt": "Pick one of abcd:", "answer": "a"}, {"prompt": "Say x or y:", "answer": "x"}]


def write_jsonl(path: Path, rows_: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows_))
    return path


def trainer(tmp_path: Path, name: str, *args: str, reward: str | None = "rewards_for_tests:char_sum"):
    """reward None: the task's default reward, so that a file's rewards column is read."""
    from longstraw_cli.trainer import Trainer

    return Trainer(train_config(composed(["model.dtype=float64", "group_size=3", "response_tokens=6", "steps=2",
                                          "logger.backends=[jsonl]", "checkpoint.enabled=false", "optim.lr=0.05",
                                          *([f"task.reward={reward}"] if reward else []), *args,
                                          f"run_dir={tmp_path / name}"])))


@pytest.mark.parametrize("model", ["qwen36_tiny", "glm52_tiny"])
def test_offline_grpo_equals_on_policy_given_the_same_responses(tmp_path, monkeypatch, model):
    """Two steps on-policy record each step's sampled responses, rewards and log-probs; training from a file of
    them gives the same losses, gradient norms and weights: with the rewards and log-probs in the file, and with
    neither (the reward called on the decoded responses, the old log-probs scored from the resident state)."""
    monkeypatch.syspath_prepend(str(E2E))
    prompts = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    online = trainer(tmp_path, "online", f"model={model}", "task=jsonl", f"task.path={prompts}")
    sampled, rewarded = [], []
    rollout, reward = online.rollout, online.reward
    online.rollout = lambda resident: sampled.append(rollout(resident)) or sampled[-1]
    online.reward = lambda example, r: rewarded.append(reward(example, r)) or rewarded[-1]
    online.train()
    assert len(sampled) == 2 and all(r.std() > 0 for r in rewarded)
    recorded = [{**row, "responses": [t.tolist() for t in r.responses], "rewards": w.tolist(),
                 "old_logprobs": [lp.tolist() for lp in r.logprobs]} for row, r, w in zip(PROMPTS, sampled, rewarded)]
    files = {"recorded": write_jsonl(tmp_path / "recorded.jsonl", recorded),
             "scored": write_jsonl(tmp_path / "scored.jsonl", [{k: v for k, v in row.items()
                                                                if k not in ("rewards", "old_logprobs")}
                                                               for row in recorded])}
    for name, path in files.items():
        # recorded: the file's rewards (no task.reward, which would compute them) and old log-probs
        offline = trainer(tmp_path, name, f"model={model}", "task=jsonl", f"task.path={path}", "rollout=data",
                          "task.logprob_key=old_logprobs" if name == "recorded" else "task.logprob_key=null",
                          reward=None if name == "recorded" else "rewards_for_tests:char_sum")
        offline.train()
        for want, got in zip(rows(tmp_path / "online"), rows(tmp_path / name)):
            for key in ("reward_mean", "loss", "grad_norm", "num_tokens"):
                assert got[key] == pytest.approx(want[key], rel=1e-10, abs=1e-12), (name, key)
        # AdamW's update of an element with a near-zero gradient carries its rounding: ~1e-12 of lr 0.05
        for got, want in zip(offline.model.parameters(), online.model.parameters()):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def given_task(tmp_path: Path, rows_: list[dict], tokenizer=None, **cfg):
    path = write_jsonl(tmp_path / "given.jsonl", rows_)
    return checked_task(TaskConfig(name="jsonl", path=str(path), given_responses=True, **cfg),
                        tokenizer or ByteTokenizer(CHATML))


def responses(task, group_size=2, response_tokens=32, stop=(258,)):
    return DataResponses(task, task.tokenizer, group_size=group_size, response_tokens=response_tokens,
                         vocab_size=259, stop_token_ids=stop, device=torch.device("cpu"))


def test_rows_of_one_prompt_form_a_group_and_responses_tokenize_as_the_template_continues(tmp_path):
    chat = [{"role": "user", "content": "2+2?"}]
    task = given_task(tmp_path, [
        {"prompt": chat, "completion": [{"role": "assistant", "content": "4"}], "reward": 1},
        {"prompt": "plain", "completion": "ab", "reward": 0.5},
        {"prompt": chat, "completion": "5", "reward": 0},
        {"prompt": "plain", "completion": [97, 258, 7], "reward": 0.25},
    ])
    assert len(task) == 2 and task.response_key == "completion" and task.reward_key == "reward"
    first, second = task.example(0), task.example(1)
    assert first.given.rewards == (1.0, 0.0) and first.given.where[1].endswith("given.jsonl:3")
    source = responses(task)
    # ChatML through the byte tokenizer: the continuation is the answer, <|im_end|> and a newline, then EOS (the
    # byte tokenizer's one stop token)
    assert [task.tokenizer.decode(ids) for ids in source.token_ids(first)] == ["4<|im_end|>\n", "5<|im_end|>\n"]
    assert source.token_ids(first)[0][-1] == 258
    # plain text: its own bytes, then EOS; token ids as given
    assert source.token_ids(second) == [[97, 98, 258], [97, 258, 7]]
    # a stop token inside a text response ends it there
    stop_at_newline = responses(task, stop=(10, 258))
    assert [ids[-1] for ids in stop_at_newline.token_ids(first)] == [10, 10]
    rollout = source(second, torch.tensor([1]))
    assert rollout.rewards == [0.5, 0.25] and rollout.logprobs is None


@pytest.mark.parametrize("row, expected", [
    ({"prompt": "p", "responses": ["a", ""]}, "given.jsonl:1: 'responses' response 1 is empty"),
    ({"prompt": "p", "responses": []}, "given.jsonl:1: 'responses' must be a response (text, chat messages"),
    ({"prompt": "p", "responses": ["a", "b"], "rewards": [1]}, "given.jsonl:1: 'rewards' must give 2 finite "
                                                              "numbers, one per response, got [1]"),
    ({"prompt": "p", "answers": ["a", "b"]}, "given.jsonl:1: rollout=data reads responses, but the row has none of "
                                             "['responses', 'completion', 'completions', 'response']"),
    ({"prompt": "p", "responses": ["a", "b"], "lp": [[-1.0], [None]]}, "given.jsonl:1: 'lp' must give 2 lists of "
                                                                       "finite log-probs, one per response"),
    ({"prompt": [{"role": "user", "content": "q"}],
      "responses": [[{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}],
                    [{"role": "assistant", "content": "c"}]]},
     "given.jsonl:1: 'responses' response 0 is chat messages of roles ['assistant', 'user']; a response is one "
     "assistant message"),
])
def test_bad_columns_are_one_line_naming_the_row(tmp_path, row, expected):
    with pytest.raises(ValueError) as e:
        given_task(tmp_path, [row], logprob_key="lp" if "lp" in row else None)
    assert str(e.value).replace(f"{tmp_path}/", "").startswith(expected), str(e.value)


@pytest.mark.parametrize("row, expected", [
    ({"prompt": "p", "responses": ["a", "b", "c"]}, "given.jsonl:1: its prompt's rows give 3 responses; group_size=2"),
    ({"prompt": "p", "responses": ["a", "b" * 40]}, "given.jsonl:1 response 1: the response is 41 tokens, over "
                                                    "response_tokens=32"),
    ({"prompt": "p", "responses": [[1, 300], [1]]}, "given.jsonl:1 response 0: token id 300 is outside the model's "
                                                    "vocabulary of 259"),
    ({"prompt": "p", "responses": [[1, 2], [1]], "lp": [[-1.0], [-1.0]]},
     "given.jsonl:1 response 0: 1 old log-probs for a response of 2 tokens"),
])
def test_bad_responses_are_one_line_naming_the_row(tmp_path, row, expected):
    task = given_task(tmp_path, [row], logprob_key="lp" if "lp" in row else None)
    with pytest.raises(InputError) as e:
        responses(task).token_ids(task.example(0))
    assert str(e.value).replace(f"{tmp_path}/", "").startswith(expected), str(e.value)


def test_text_past_a_stop_token_is_refused_and_task_reward_replaces_the_files_rewards(tmp_path):
    """A response that goes on past a stop token would lose the rest unseen: one line. With task.reward set the
    reward computes the rewards and the file's column is not read (both named at once is refused in one line)."""
    task = given_task(tmp_path, [{"prompt": "p", "responses": ["a\nb", "c"], "rewards": [1, 0]}])
    with pytest.raises(InputError, match=r"given.jsonl:1 response 0: the response goes on past a stop token "
                                         r"\('\\n'\) with 'b'"):
        responses(task, stop=(10, 258)).token_ids(task.example(0))
    assert responses(task).__call__(task.example(0), torch.tensor([1])).rewards == [1.0, 0.0]
    # the columns read as given are the rollout's: a reward is not handed them (it reads the decoded responses)
    assert task.example(0).meta == {}
    # task.reward set (given_rewards false): the rewards column is not read; it is a column like any other
    computed = given_task(tmp_path, [{"prompt": "p", "responses": ["a", "c"], "rewards": [1, 0], "id": 7}],
                          given_rewards=False)
    assert computed.reward_key is None and computed.example(0).given.rewards is None
    assert responses(computed).__call__(computed.example(0), torch.tensor([1])).rewards is None
    assert computed.example(0).meta == {"id": 7, "rewards": [1, 0]}
    with pytest.raises(ConfigError, match="task.reward=exact computes the rewards and task.reward_key=rewards reads"):
        train_config({**composed(["task=jsonl", f"task.path={tmp_path / 'given.jsonl'}", "rollout=data",
                                  "task.reward=exact", "task.reward_key=rewards"]), "run_dir": "runs/x"})


def test_synthetic_responses_are_seeded_random_ids_of_exactly_response_tokens():
    def draw(seed):
        source = SyntheticResponses(group_size=3, response_tokens=7, vocab_size=259,
                                    generator=torch.Generator().manual_seed(seed), device=torch.device("cpu"))
        return source(None, torch.tensor([1]))

    a, b, c = draw(0), draw(0), draw(1)
    assert [len(r) for r in a.responses] == [7, 7, 7] and a.logprobs is None and len(a.rewards) == 3
    assert all(torch.equal(x, y) for x, y in zip(a.responses, b.responses)) and a.rewards == b.rewards
    assert not torch.equal(a.responses[0], c.responses[0])
    assert max(int(r.max()) for r in a.responses) < 259


@pytest.mark.parametrize("args, expected", [
    (["algo=sft"], "algo=sft trains on given responses, not sampled ones: needs rollout=data (or "
                   "rollout=synthetic, for benchmarks); got rollout=native"),
    (["algo=sft", "rollout=vllm"], "got rollout=vllm"),
    (["rollout=data", "task=passkey"], "rollout=data reads responses from the task's rows: needs a file task; "
                                       "valid: ['task=dataset', 'task=jsonl']; got task=passkey"),
    (["algo.advantage=one"], "algo.advantage=one is a weight; algo=grpo takes a baseline: valid: ['dr_grpo', "
                             "'grpo']"),
    (["algo=sft", "rollout=synthetic", "algo.advantage=grpo"], "algo.advantage=grpo is a baseline; algo=sft takes "
                                                               "a weight: valid: ['one', 'reward']"),
    (["rollout=synthetic", "group_size=1"], "group_size must be an integer >= 2, got 1"),
])
def test_what_does_not_go_together_is_refused_in_one_line(args, expected):
    with pytest.raises(ConfigError) as e:
        train_config({**composed(args), "run_dir": "runs/x"})
    assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_sft_takes_groups_of_one():
    cfg = train_config({**composed(["algo=sft", "rollout=synthetic", "group_size=1"]), "run_dir": "runs/x"})
    assert (cfg.loss.name, cfg.loss.aggregation, cfg.transaction.advantage, cfg.group_size) == (
        "sft", "token_mean", "one", 1)


def test_sft_replays_no_routing_and_the_plan_scores_only_what_runs(tmp_path):
    """algo=sft has no rollout routing to replay: replay_routing auto is off for it (the trainer and the plan read
    the one resolved value), on is refused. The plan has a score phase for given responses only where their old
    log-probs are not in the file (task.logprob_key) or their routing must be recorded there."""
    from omegaconf import OmegaConf

    from longstraw_cli.cli import plan_arguments

    sft = ["model=glm52_tiny", "algo=sft", "rollout=synthetic"]
    assert train_config({**composed(sft), "run_dir": "runs/x"}).rollout.replay_routing is False
    with pytest.raises(ConfigError, match="rollout.replay_routing=true replays the routing of sampled responses"):
        train_config({**composed([*sft, "rollout.replay_routing=true"]), "run_dir": "runs/x"})
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "responses": [[1, 2], [3]], "lp": [[-1, -1], [-1]]}])
    data = ["task=jsonl", f"task.path={path}", "rollout=data", "group_size=2"]

    def scoring(*args):
        cfg = OmegaConf.create(composed(list(args)))
        return plan_arguments(cfg, gpu_mem_gib=80, host_mem_gib=64)[2]["scoring"]

    assert scoring(*data) and not scoring(*data, "task.logprob_key=lp")
    # glm52 records the responses' routing at scoring (they came with none), so it scores
    assert scoring(*data, "task.logprob_key=lp", "model=glm52_tiny")
    assert not scoring(*sft) and plan_arguments(OmegaConf.create(composed(sft)), gpu_mem_gib=80,
                                                host_mem_gib=64)[2]["replay_routing"] is False
