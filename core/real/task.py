"""The task of the real runtimes: prompts, and a reward anyone can verify from the text.

A prompt is k distinct letters of the first ``alphabet`` of a-z, and ``=`` (``"c a f ="``). A good response repeats letters of
the prompt, at least ``target = length_per_letter * k**2`` of them, and then stops:

    reward = in_prompt * min(1, n / target)                    if it ended with <eos>, n <= target
    reward = in_prompt * (target / n) ** overshoot              if it ended with <eos>, n > target
    reward = 0                                                 if it ran into the cap (``truncated_reward``
                                                               times the above, if set)

where n is the response length before <eos> and ``in_prompt`` the fraction of its words that
are letters of the prompt. The policy decides when to stop, so response lengths really vary,
and as in reasoning tasks the harder prompts need much longer answers: the target grows with
the square of k (8 to 72 words with the defaults), while a random policy stops on <eos> about
once per vocabulary size tokens (a geometric tail). The reward both lengthens short responses
and cuts those that never stop. With ``overshoot`` above 0 the reward peaks at the target, so
a response learns to stop near it rather than anywhere before the cap: the gradient then
points back toward the target from both sides, which stale feedback overshoots less than
a one-sided push held back only by the cliff at the cap (docs/results).

The reward is computed on the decoded text, not on token ids, so it is the same whoever
tokenizes (the trainer, vLLM, the reward service).
"""

from __future__ import annotations

import string
from typing import Sequence

import numpy as np

LETTERS = tuple(string.ascii_lowercase)
DIGITS = tuple(string.digits)
PAD, EOS, BOS, SEP = "<pad>", "<eos>", "<bos>", "="
SPECIAL = (PAD, EOS, BOS)
# Held-out evaluation prompts come from their own random stream (see ``Task.tokens``).
EVAL_STREAM = 7


class Task:
    """Deterministic prompts per (seed, prompt id); rewards from the decoded response."""

    def __init__(
        self,
        seed: int,
        alphabet: int,
        min_letters: int,
        max_letters: int,
        length_per_letter: int,
        truncated_reward: float,
        overshoot: float,
        encode,
        decode,
    ) -> None:
        """``encode(text) -> list[int]`` and ``decode(ids) -> str`` come from the tokenizer."""
        self.seed = seed
        self.alphabet = alphabet
        self.min_letters = min_letters
        self.max_letters = max_letters
        self.length_per_letter = length_per_letter
        self.truncated_reward = truncated_reward
        self.overshoot = overshoot
        self._encode = encode
        self._decode = decode

    def prompt_text(self, prompt_id: int, held_out: bool = False) -> str:
        stream = EVAL_STREAM if held_out else 0
        rng = np.random.default_rng([self.seed, stream, prompt_id])
        k = int(rng.integers(self.min_letters, self.max_letters + 1))
        letters = rng.choice(self.alphabet, size=k, replace=False)
        return " ".join(LETTERS[i] for i in letters) + " " + SEP

    def tokens(self, prompt_id: int, held_out: bool = False) -> np.ndarray:
        """The prompt's token ids, <bos> first."""
        return np.asarray(self._encode(f"{BOS} " + self.prompt_text(prompt_id, held_out)), dtype=np.int64)

    def reward(self, prompt_id: int, response_tokens: Sequence[int], held_out: bool = False) -> float:
        text = self._decode(list(response_tokens))
        return score_text(
            self.prompt_text(prompt_id, held_out), text, self.length_per_letter, self.truncated_reward, self.overshoot
        )


def score_text(prompt: str, response: str, length_per_letter: int, truncated_reward: float, overshoot: float) -> float:
    """The reward of one response text (words separated by spaces) to one prompt text."""
    allowed = set(prompt.split()) - {SEP}
    words = response.split()
    share = 1.0
    if EOS in words:
        words = words[: words.index(EOS)]
    else:
        share = truncated_reward
    if not words or share == 0.0:
        return 0.0
    in_prompt = sum(w in allowed for w in words) / len(words)
    target = length_per_letter * len(allowed) ** 2
    n = len(words)
    reached = n / target if n <= target else (target / n) ** overshoot
    return share * in_prompt * reached


def corpus(n_lines: int, seed: int) -> list[str]:
    """Text in the task's language, to train the tokenizer on: every symbol a prompt or a
    response can hold appears in it."""
    rng = np.random.default_rng([seed, 11])
    symbols = LETTERS + DIGITS + (SEP,)
    lines = []
    for _ in range(n_lines):
        k = int(rng.integers(1, 24))
        lines.append(" ".join(symbols[i] for i in rng.integers(0, len(symbols), size=k)))
    return lines
