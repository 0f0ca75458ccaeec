"""Reward functions of a user's own, named by reward.fn in tests/test_byo.py and the bad-input
corpus: imported by name, in the test's process and in Ray Serve replicas alike."""

calls: list[tuple] = []


def length_share(prompt, response, answer, finished):
    """Longer finished responses score more, up to 8 words; every call is recorded."""
    calls.append((prompt, response, answer, finished))
    return min(1.0, len(response.split()) / 8) if finished else 0.0


def keywords_only(*, prompt, response, answer, finished, **extra):
    return 1.0 if answer is not None and answer in response else 0.0


def wrong_signature(text):
    return 0.0


async def is_async(prompt, response, answer, finished):
    return 0.0


def not_a_number(prompt, response, answer, finished):
    return "high"


def infinite(prompt, response, answer, finished):
    return float("inf")


NOT_A_FUNCTION = 3


def fails_now_and_then(prompt, response, answer, finished):
    """``length_share``, except that every 40th call in a process raises."""
    global _calls
    _calls += 1
    if _calls % 40 == 7:
        raise ValueError(f"call {_calls} failed")
    return length_share(prompt, response, answer, finished)


def always_fails(prompt, response, answer, finished):
    raise ValueError("no verifier for this answer")


_calls = 0


def constant_when_even(prompt, response, answer, finished):
    """0.5 for every response to a prompt of an even number of words (a group with no reward
    variance); ``length_share`` for the others."""
    return 0.5 if len(prompt.split()) % 2 == 0 else length_share(prompt, response, answer, finished)
