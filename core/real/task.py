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

Prompts may come from a file instead (``task.prompts``, ``FilePrompts``) and the reward from a
function of the user's (``reward.fn``, ``GuardedReward``); ``Task`` puts any prompts and any
reward on one tokenizer.
"""

from __future__ import annotations

import logging
import math
import string
from functools import lru_cache
from typing import Callable, Optional, Sequence

import numpy as np

from core.agent.tool_call import RESPONSE_CLOSE, RESPONSE_OPEN
from core.model.prompt_file import PromptRow
from core.model.reward_fn import REWARD_FAILED
from core.model.user_code import UserCodeError

log = logging.getLogger(__name__)

# Failed reward calls that reward.on_error: skip drops before it looks at their share: past
# this, more than half of the calls failing ends the run.
SKIPPED_AT_LEAST = 16

LETTERS = tuple(string.ascii_lowercase)
DIGITS = tuple(string.digits)
PAD, EOS, BOS, SEP = "<pad>", "<eos>", "<bos>", "="
SPECIAL = (PAD, EOS, BOS)
# Held-out evaluation prompts come from their own random stream (see ``Task.tokens``).
EVAL_STREAM = 7


class LetterPrompts:
    """The letters task's prompts: deterministic per (seed, prompt id), with no answer."""

    def __init__(self, seed: int, alphabet: int, min_letters: int, max_letters: int) -> None:
        self.seed = seed
        self.alphabet = alphabet
        self.min_letters = min_letters
        self.max_letters = max_letters

    def text(self, prompt_id: int, held_out: bool = False) -> str:
        stream = EVAL_STREAM if held_out else 0
        rng = np.random.default_rng([self.seed, stream, prompt_id])
        k = int(rng.integers(self.min_letters, self.max_letters + 1))
        letters = rng.choice(self.alphabet, size=k, replace=False)
        return " ".join(LETTERS[i] for i in letters) + " " + SEP

    def answer(self, prompt_id: int, held_out: bool = False) -> Optional[str]:
        return None

    def where(self, prompt_id: int, held_out: bool = False) -> str:
        """Where the prompt comes from, for an error: a generated prompt's text says it all."""
        return repr(self.text(prompt_id, held_out))


class FilePrompts:
    """Prompts of a file (``task.prompts``): prompt id i is row i of a pass over the rows in an
    order the seed shuffles anew each pass; held-out ids index ``eval_rows`` in file order."""

    def __init__(self, rows: Sequence[PromptRow], eval_rows: Optional[Sequence[PromptRow]], seed: int) -> None:
        self.rows = rows
        self.eval_rows = eval_rows
        self.seed = seed

    def _row(self, prompt_id: int, held_out: bool) -> PromptRow:
        if held_out:
            if not self.eval_rows:
                raise ValueError("held-out prompts of a prompts file come from task.eval_prompts, and none was given")
            return self.eval_rows[prompt_id % len(self.eval_rows)]
        epoch, i = divmod(prompt_id, len(self.rows))
        return self.rows[int(_pass_order(self.seed, epoch, len(self.rows))[i])]

    def text(self, prompt_id: int, held_out: bool = False) -> str:
        return self._row(prompt_id, held_out).prompt

    def answer(self, prompt_id: int, held_out: bool = False) -> Optional[str]:
        return self._row(prompt_id, held_out).answer

    def where(self, prompt_id: int, held_out: bool = False) -> str:
        """'line 4 of task.prompts': the row's place in its file."""
        row = self._row(prompt_id, held_out)
        return f"{row.where} of {'task.eval_prompts' if held_out else 'task.prompts'}" if row.where else ""


class ArithmeticPrompts:
    """The arithmetic task's prompts: ``a*b=`` of two ``digits``-digit numbers, deterministic per
    (seed, prompt id); the answer is the product. Warm-start demonstrations (``stream``
    ``WARM_STREAM``) never meet the training or held-out prompts' streams."""

    def __init__(self, seed: int, digits: int) -> None:
        self.seed = seed
        self.digits = digits

    def operands(self, prompt_id: int, stream: int) -> tuple[int, int]:
        lo, hi = 10 ** (self.digits - 1), 10 ** self.digits
        a, b = np.random.default_rng([self.seed, stream, prompt_id]).integers(lo, hi, size=2)
        return int(a), int(b)

    def text(self, prompt_id: int, held_out: bool = False) -> str:
        a, b = self.operands(prompt_id, EVAL_STREAM if held_out else 0)
        return f"{a}*{b}{SEP}"

    def answer(self, prompt_id: int, held_out: bool = False) -> Optional[str]:
        a, b = self.operands(prompt_id, EVAL_STREAM if held_out else 0)
        return str(a * b)

    def where(self, prompt_id: int, held_out: bool = False) -> str:
        return repr(self.text(prompt_id, held_out))


WARM_STREAM = 13
# The arithmetic reward of a correct call whose answer the response did not copy: the share of
# episodes that call the tool right is a signal of its own, before the copy is learned.
CALLED_RIGHT = 0.25


def arithmetic_score(prompt: str, response: str, answer: Optional[str], finished: bool) -> float:
    """1 for a response that ended with the answer after its last tool answer (the text the model
    wrote itself); ``CALLED_RIGHT`` if a tool answered the answer but the response did not end
    with it; else 0."""
    if answer is None:
        return 0.0
    tail = response.rsplit(RESPONSE_CLOSE, 1)[-1]
    if finished and tail.strip() == answer:
        return 1.0
    answered = [part.split(RESPONSE_CLOSE, 1)[0].strip() for part in response.split(RESPONSE_OPEN)[1:]]
    return CALLED_RIGHT if answer in answered else 0.0


@lru_cache(maxsize=4)
def _pass_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """The row order of one pass; groups of two passes can be scored side by side."""
    return np.random.default_rng([seed, epoch]).permutation(n)


class LetterScore:
    """The letters task's reward (``score_words``) as a reward function."""

    def __init__(self, length_per_letter: int, truncated_reward: float, overshoot: float) -> None:
        self.length_per_letter = length_per_letter
        self.truncated_reward = truncated_reward
        self.overshoot = overshoot

    def __call__(self, prompt: str, response: str, answer: Optional[str], finished: bool) -> float:
        return score_words(prompt, response.split(), finished, self.length_per_letter, self.truncated_reward, self.overshoot)


def exact_match(prompt: str, response: str, answer: Optional[str], finished: bool) -> float:
    """The reward of a prompts file without ``reward.fn``: 1 for a response that ended and
    equals the answer, whitespace around either stripped; else 0."""
    return float(finished and answer is not None and response.strip() == answer.strip())


class Task:
    """Prompts as token ids, and the reward of a response, on one tokenizer.

    A prompt is ``<bos>`` (when the tokenizer has one) and its text; a response ends at its
    first end-of-sequence token, and its text before that token (special tokens as text) is
    what ``score(prompt=, response=, answer=, finished=)`` is given.
    """

    def __init__(self, prompts, score: Callable[..., float], encode, decode, bos_id: Optional[int], eos_ids,
                 max_positions: Optional[int] = None, skip_failed: bool = False, max_response_len: int = 1,
                 truncation: str = "error") -> None:
        """``encode(text) -> list[int]`` and ``decode(ids) -> str`` come from the tokenizer;
        ``max_positions``: the model's, in which a file's prompts must leave ``max_response_len``
        for a response, else are cut as ``truncation`` says (``task.prompt_truncation``);
        ``skip_failed``: a reward function that fails gives ``REWARD_FAILED`` (its group is
        dropped) instead of raising (``reward.on_error: skip``)."""
        self.skip_failed = skip_failed
        self._calls = self._failed = 0  # reward calls, and those that failed and were skipped
        self.prompts = prompts
        self.max_positions = max_positions
        self.max_response_len = max_response_len
        self.truncation = truncation
        self.score = score
        self._encode = encode
        self._decode = decode
        self._bos = [] if bos_id is None else [int(bos_id)]
        self._eos = frozenset(int(e) for e in eos_ids)
        # Tokens a prompt's text may have: <bos> and the response take the rest of the positions.
        self._text_room = None if max_positions is None else max(max_positions - max_response_len - len(self._bos), 0)

    def prompt_text(self, prompt_id: int, held_out: bool = False) -> str:
        return self.prompts.text(prompt_id, held_out)

    def encode(self, text: str) -> list[int]:
        """``text``'s token ids, no <bos>: how an agent loop writes a tool's answer."""
        return list(self._encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens as text: how an agent loop reads a model's turn."""
        return self._decode(ids)

    @property
    def eos_ids(self) -> frozenset[int]:
        return self._eos

    def tokens(self, prompt_id: int, held_out: bool = False) -> np.ndarray:
        """The prompt's token ids, <bos> first; a text longer than the positions a response leaves
        it is cut on the left (its end kept) or the right (its beginning kept), as ``truncation``
        says."""
        ids = list(self._encode(self.prompt_text(prompt_id, held_out)))
        room = self._text_room
        if room is not None and len(ids) > room and self.truncation != "error":
            ids = ids[len(ids) - room:] if self.truncation == "left" else ids[:room]
        return np.asarray(self._bos + ids, dtype=np.int64)

    def check_lengths(self) -> None:
        """Every prompt of a file fits beside a response in the model's positions: ``ValueError``
        naming the first that does not, or, when ``truncation`` cuts them, a warning saying how
        many are cut. A ``model.path``'s prompts are refused with the scenario already; the tiny
        model's tokenizer is built with the run, so its prompts are counted here (the letters
        task's fit by construction)."""
        room = self._text_room
        if not isinstance(self.prompts, FilePrompts) or room is None:
            return
        for key, rows in (("task.prompts", self.prompts.rows), ("task.eval_prompts", self.prompts.eval_rows or ())):
            over = [(row, n) for row in rows if (n := len(self._encode(row.prompt))) > room]
            if not over:
                continue
            if self.truncation == "error":
                row, n = over[0]
                raise ValueError(f"{key}: the prompt of {row.where} is {n + len(self._bos)} tokens, leaving no room for a response of "
                                 f"workload.max_response_len = {self.max_response_len} in the model's {self.max_positions} positions; "
                                 "fix: shorten or drop it, or set task.prompt_truncation: left or right")
            log.warning("%s: %d of its %d prompts are longer than the %d tokens the model's %d positions leave beside a response of %d; "
                        "each is cut to its %s %d tokens (task.prompt_truncation: %s)", key, len(over), len(rows), room + len(self._bos),
                        self.max_positions, self.max_response_len, "last" if self.truncation == "left" else "first", room, self.truncation)

    def reward(self, prompt_id: int, response_tokens: Sequence[int], held_out: bool = False, sample: Optional[int] = None) -> float:
        """The reward of a response (``sample``: its uid, named if a reward function fails on it)."""
        ids = [int(t) for t in response_tokens]
        end = next((i for i, t in enumerate(ids) if t in self._eos), None)
        text = self._decode(ids if end is None else ids[:end])
        self._calls += 1
        try:
            return self.score(
                prompt=self.prompt_text(prompt_id, held_out), response=text,
                answer=self.prompts.answer(prompt_id, held_out), finished=end is not None,
            )
        except UserCodeError as exc:
            exc = exc.doing_instead(self._scoring(prompt_id, held_out, sample))
            if not self.skip_failed:
                raise exc from None
            self._failed += 1
            if self._failed >= SKIPPED_AT_LEAST and 2 * self._failed > self._calls:
                # Skipping would drop nearly every group: the trainer would wait for ever.
                raise UserCodeError(exc.key, exc.name, exc.doing, f"{exc.did} ({self._failed} of its {self._calls} calls "
                                    "failed, more than half; skipping drops a group now and then, not most)",
                                    "make it score most responses, starting with the one named here") from None
            log.warning("%s %s: %s; its group is dropped (reward.on_error: skip)", exc.key, exc.name, exc.problem)
            return REWARD_FAILED

    def _scoring(self, prompt_id: int, held_out: bool, sample: Optional[int]) -> str:
        """'scoring sample 12 of prompt 3 (line 4 of task.prompts)': which response failed."""
        what = "a held-out response" if sample is None else f"sample {sample}"
        where = self.prompts.where(prompt_id, held_out)
        return f"scoring {what} of prompt {prompt_id}" + (f" ({where})" if where else "")


def score_text(prompt: str, response: str, length_per_letter: int, truncated_reward: float, overshoot: float) -> float:
    """The reward of one response text (words separated by spaces, ended by the word <eos>) to one prompt text."""
    words = response.split()
    finished = EOS in words
    return score_words(prompt, words[: words.index(EOS)] if finished else words, finished, length_per_letter, truncated_reward, overshoot)


def score_words(prompt: str, words: list[str], finished: bool, length_per_letter: int, truncated_reward: float, overshoot: float) -> float:
    """The letters reward of a response's words before <eos>; ``finished``: it had an <eos>."""
    allowed = set(prompt.split()) - {SEP}
    share = 1.0 if finished else truncated_reward
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
