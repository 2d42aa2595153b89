"""Rewards for end-to-end tests that need a gradient at every step (a random tiny model rarely earns a task's
reward, and a group of equal rewards has zero advantages)."""


def response_length(response: str, example) -> float:
    """Varies within almost every group of sampled responses."""
    return float(len(response))


def char_sum(response: str, example) -> float:
    """Varies within almost every group, even when all responses have the same length."""
    return sum(map(ord, response)) / 1000
