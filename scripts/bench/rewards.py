"""Rewards for benchmarks on random weights, where every task reward is 0 for every response (so the advantages,
the gradient and the drift between steps are 0 too). These give a varied signal so that the weights move.

    longstraw train ... task.reward=scripts/bench/rewards.py:byte_share
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


def byte_share(response: str, example) -> float:
    """Share of the response's characters that decode to text (ids outside the byte tokenizer decode as U+FFFD):
    about 1 in 1,000 for a random 248K-vocabulary model, different in every response."""
    if not response:
        return 0.0
    return 1.0 - response.count(REPLACEMENT) / len(response)
