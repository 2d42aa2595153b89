"""Rewards for end-to-end tests that need a gradient at every step (a random tiny model rarely earns a task's
reward, and a group of equal rewards has zero advantages)."""


def response_length(response: str, example) -> float:
    """Varies within almost every group of sampled responses."""
    return float(len(response))


def as_string(response: str, example):
    """Not a number: a reward must not pass this off as 0.5."""
    return "0.5"
