"""Rewards for end-to-end tests that need a gradient at every step (a random tiny model rarely earns a task's
reward, and a group of equal rewards has zero advantages)."""


def response_length(response: str, example) -> float:
    """Varies within almost every group of sampled responses."""
    return float(len(response))


def char_sum(response: str, example) -> float:
    """Varies within almost every group, even when all responses have the same length."""
    return sum(map(ord, response)) / 1000


def ascii_count(response: str, example) -> float:
    """Dense and learnable: about half of a random byte-level model's tokens are ASCII, so the count varies within
    every group and a policy update can move it."""
    return float(sum(ord(c) < 128 for c in response))


def ascii_share(response: str, example) -> float:
    return sum(ord(c) < 128 for c in response) / max(len(response), 1)


def non_ascii_share(response: str, example) -> float:
    return 1.0 - ascii_share(response, example) if response else 0.0


def overflow_from_example_2(response: str, example) -> float:
    """Finite, but so large that advantages overflow from example 2 on: the loss turns NaN."""
    return 1e308 if example.meta["index"] >= 2 else float(len(response))


def as_string(response: str, example):
    """Not a number: a reward must not pass this off as 0.5."""
    return "0.5"



def verl_extras(data_source, solution_str, ground_truth, extra_info=None):
    """verl's style with extra figures: `chars` for every response, and a key named by the parity of the answer's
    characters (`parity_0`, `parity_1`), which two data-parallel ranks' prompts of one step may not share."""
    return {"score": len(solution_str) / 10, "chars": len(solution_str),
            f"parity_{sum(map(ord, ground_truth)) % 2}": 1.0}
