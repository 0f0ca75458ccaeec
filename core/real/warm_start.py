"""A warm start for the tiny model on the arithmetic task: supervised steps on demonstrations
of the tool's use, after the random initialisation and before any RL.

A random model never finds a well-formed call by chance (a call is 7 tokens in a row, at one
in ~40 each), so, as agent recipes start RL from a model that has seen the tool's format, the
tiny model is shown ``warm_start_steps`` batches of demonstrations::

    <bos>37*48=  <tool_call>{..."expression": "37*48"}</tool_call>  <tool_response>1776</tool_response>  1776<eos>
    prompt       trained                                           masked (the tool writes it)          trained

Few steps leave it able to call the tool now and then, and to copy the answer less often:
what RL then has to raise. Demonstrations come from their own prompt stream.
"""

from __future__ import annotations

import logging

from core.agent.tool_call import CALCULATOR_HEAD, CALCULATOR_TAIL, CLOSE, OPEN, RESPONSE_CLOSE, RESPONSE_OPEN
from core.real.task import BOS, EOS, WARM_STREAM, ArithmeticPrompts

log = logging.getLogger(__name__)

BATCH = 32
LR = 1e-3


def demonstration(encode, seed: int, i: int) -> tuple[list[int], list[float]]:
    """Token ids of demonstration ``i`` and a loss weight per id (1 where the model writes).
    Operands of 1 to 3 digits: the calls are copied, whatever ``task.digits`` is."""
    a, b = ArithmeticPrompts(seed, 1 + i % 3).operands(i, WARM_STREAM)
    expr, answer = f"{a}*{b}", str(a * b)
    parts = [
        (f"{BOS}{expr}=", 0.0),
        (f"{OPEN}{CALCULATOR_HEAD}{expr}{CALCULATOR_TAIL}{CLOSE}", 1.0),
        (f"{RESPONSE_OPEN}{answer}{RESPONSE_CLOSE}", 0.0),
        (f"{answer}{EOS}", 1.0),
    ]
    ids: list[int] = []
    weights: list[float] = []
    for text, w in parts:
        part = encode(text)
        ids += part
        weights += [w] * len(part)
    return ids, weights


def warm_start(model, tokenizer, steps: int, seed: int) -> None:
    """``steps`` AdamW steps on batches of demonstrations, in place."""
    import torch

    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model.train()
    loss = torch.zeros(())
    for step in range(steps):
        rows = [demonstration(encode, seed, step * BATCH + j) for j in range(BATCH)]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.tensor([r + [0] * (width - len(r)) for r, _ in rows])
        w = torch.tensor([x + [0.0] * (width - len(x)) for _, x in rows])
        logits = model(input_ids=ids).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
        loss = (nll * w[:, 1:].reshape(-1)).sum() / w[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    log.info("warm start: %d steps of %d demonstrations, last loss %.3f", steps, BATCH, float(loss.detach()))
