"""What a step keeps of its responses for the user: a few samples to read, and the means of a reward's extra figures.

`logger.samples=N` (0: none): rank 0's first N responses of each step (its first prompt's, then the next prompt's
where prompts_per_step > 1), each with the tail of its prompt as the model read it (the last PROMPT_TAIL_CHARS
characters: a prompt may hold a million tokens), where the prompt came from, the answer its row holds, the response,
its reward and its length in tokens. metrics.py writes them to run_dir/samples.jsonl (one JSON object a line, cut
back on resume as metrics.jsonl is) and, with those backends, as a W&B table and TensorBoard text.

A reward's extra figures (rl/reward_adapters.py: a verl reward's dict keys beside "score") become the step's
`reward/<key>` metrics: each key's mean over the step's responses that gave it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from longstraw_cli.rl.reward_adapters import Scores
    from longstraw_cli.rl.tasks import Example

SAMPLES_FILE = "samples.jsonl"
PROMPT_TAIL_CHARS = 500
# a sample's columns, in the order of the W&B table
COLUMNS = ("step", "origin", "prompt_tail", "answer", "response", "reward", "response_tokens")


class StepRecord:
    """One step's samples (up to `num_samples`) and the sums and counts of its rewards' extra figures."""

    def __init__(self, num_samples: int):
        self.num_samples = num_samples
        self.samples: list[dict] = []
        self.extra_sums: dict[str, list[float]] = {}

    def add(self, example: Example, prompt_text: Callable[[], str], responses: Sequence[str],
            lengths: Sequence[int], scores: Scores) -> None:
        """One prompt's group. `prompt_text` renders the prompt, called only where a sample is kept."""
        for extra in scores.extra:
            for key, value in extra.items():
                total = self.extra_sums.setdefault(key, [0.0, 0])
                total[0] += value
                total[1] += 1
        room = min(self.num_samples - len(self.samples), len(responses))
        if room <= 0:
            return
        tail = prompt_text()[-PROMPT_TAIL_CHARS:]
        for i in range(room):
            extra = scores.extra[i] if scores.extra else {}
            self.samples.append({"origin": example.origin, "prompt_tail": tail, "answer": example.answer,
                                 "response": responses[i], "reward": scores.values[i],
                                 "response_tokens": int(lengths[i]), **{f"reward/{k}": v for k, v in extra.items()}})


def extra_means(sums: dict[str, list[float]]) -> dict[str, float]:
    """`reward/<key>`: each extra figure's mean, from {key: [sum, count]}."""
    return {f"reward/{key}": total / count for key, (total, count) in sorted(sums.items()) if count}


def merge_sums(parts: Sequence[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Several ranks' {key: [sum, count]} as one (a key some ranks' rewards did not give counts where it was)."""
    merged: dict[str, list[float]] = {}
    for part in parts:
        for key, (total, count) in part.items():
            into = merged.setdefault(key, [0.0, 0])
            into[0] += total
            into[1] += count
    return merged


def extra_columns(rows: Sequence[dict]) -> list[str]:
    """The rows' keys past COLUMNS (a reward's extra figures, `reward/<key>`), sorted."""
    return sorted({key for row in rows for key in row if key not in COLUMNS})


def markdown(step: int, samples: Sequence[dict]) -> str:
    """The samples as TensorBoard's text plugin shows them: a heading each, the prompt's tail and the response as
    code blocks (kept as written: no markdown inside them)."""
    blocks = []
    for i, sample in enumerate(samples):
        extra = "".join(f", {key} {sample[key]:.4g}" for key in extra_columns([sample]))
        blocks.append(f"**step {step}, sample {i}**: reward {sample['reward']:.4g}{extra}, {sample['response_tokens']} "
                      f"tokens, {sample['origin']}, answer `{sample['answer']}`\n\n"
                      f"prompt (its last {PROMPT_TAIL_CHARS} characters):\n\n{_code(sample['prompt_tail'])}\n\n"
                      f"response:\n\n{_code(sample['response'])}")
    return "\n\n".join(blocks)


def _code(text: str) -> str:
    # indented four spaces: a code block whatever backticks the text holds
    return "\n".join("    " + line for line in text.split("\n"))
