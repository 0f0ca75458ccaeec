"""The agent loop (core/agent/loop.py) on a scripted engine: episodes of many turns, tools
answered and masked out of the loss, limits that end episodes with a reason, and interruptions
(a sync that aborts mid-turn or while a tool runs, a cancelled generation, a checkpoint) after
which each call id has run exactly once."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections import Counter

import numpy as np
import pytest

from core.agent.loop import Limits, ToolLoop, TurnCodec
from core.agent.tool_call import RESPONSE_CLOSE, RESPONSE_OPEN
from core.agent.tools import Tool, ToolBox
from core.model.sample import Group, Sample

# A character-level tokenizer whose tags are one token each, as a chat model's are.
TAGS = ["<eos>", "<tool_call>", "</tool_call>", RESPONSE_OPEN, RESPONSE_CLOSE]
EOS, CALL_END = 0, 2
_TAG = re.compile("|".join(re.escape(t) for t in TAGS[1:]) + "|.", re.DOTALL)


def encode(text: str) -> list[int]:
    return [TAGS.index(m) if m in TAGS else 16 + ord(m) for m in _TAG.findall(text)]


def decode(ids) -> str:
    return "".join(TAGS[i] if i < len(TAGS) else chr(i - 16) for i in ids)


CODEC = TurnCodec(CALL_END, frozenset({EOS}), encode, decode)


def call(key: str, name: str = "count") -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": {"key": key}}) + "</tool_call>"


class ScriptedEngine:
    """Plays a script: ``turns(sample, k)`` is the text of episode ``sample``'s ``k``-th model
    turn. One token per tick (``tick_s``), up to the cap, stopping at ``stop_ids`` or <eos>;
    ``abort_all`` interrupts, the partial turn kept and completed by the next call."""

    name = "scripted"

    def __init__(self, turns, tick_s: float = 0.0) -> None:
        self.turns = turns
        self.tick_s = tick_s
        self._aborted: set[int] = set()
        self._live: set[int] = set()
        self.calls = 0

    async def generate(self, group: Group, max_response_len: int, stop_ids=frozenset()) -> bool:
        self.calls += 1
        return all(await asyncio.gather(*(self._one(s, max_response_len, stop_ids) for s in group.unfinished())))

    async def _one(self, s: Sample, cap: int, stop_ids) -> bool:
        k = len(s.observations)
        start = s.observations[-1][0] + s.observations[-1][1] if s.observations else 0
        want = encode(self.turns(s, k)) + ([EOS] if not self.turns(s, k).endswith("</tool_call>") else [])
        done = s.n_response - start  # of this turn, before an interruption
        self._live.add(s.uid)
        try:
            for tok in want[done:]:
                if s.n_response >= cap:
                    break
                await asyncio.sleep(self.tick_s)
                if s.uid in self._aborted:
                    return False
                s.add_tokens(1, 0, [tok], [-0.5])
                if tok == EOS or tok in stop_ids:
                    break
        finally:
            self._live.discard(s.uid)
            self._aborted.discard(s.uid)
        s.finished = True
        return True

    async def abort_all(self) -> int:
        self._aborted |= self._live
        return len(self._live)


class Counting:
    """A tool that counts its executions per key (under a lock: calls run in threads)."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.runs: Counter = Counter()
        self._lock = threading.Lock()

    def __call__(self, key: str) -> str:
        time.sleep(self.delay_s)
        with self._lock:
            self.runs[key] += 1
        return f"ok {key}"


def make_loop(tool=None, max_turns=8, max_tool_calls=16, max_episode_tokens=100_000, extra=()):
    tool = tool or Counting()
    box = ToolBox([Tool("count", tool, 5.0), *extra])
    return ToolLoop(box, CODEC, Limits(max_turns, max_tool_calls, max_episode_tokens)), tool


def make_group(n: int = 4, prompt_id: int = 0) -> Group:
    prompt = np.asarray(encode("Q?"), dtype=np.int64)
    return Group(prompt_id, [Sample(prompt_id * n + i, prompt_id, i, len(prompt), prompt) for i in range(n)], 0, 0.0)


def calls_then_answer(n_calls):
    """Episode ``uid`` makes ``n_calls(uid)`` calls, one a turn, then answers."""
    def turns(s: Sample, k: int) -> str:
        return call(f"{s.uid}-{k}") if k < n_calls(s.uid) else f"answer {s.uid}"
    return turns


def run(coro):
    return asyncio.run(coro)


def never() -> asyncio.Event:
    """A cut that never comes."""
    return asyncio.Event()


def test_episodes_call_tools_and_the_answers_are_masked():
    loop, tool = make_loop()
    eng = ScriptedEngine(calls_then_answer(lambda uid: uid % 3))  # 0, 1, 2, 0 calls
    g = make_group(4)
    assert run(loop.run(g, eng, 10_000, never())) is True
    for s in g.samples:
        k = s.uid % 3
        text = decode(s.response_tokens)
        want = "".join(call(f"{s.uid}-{j}") + f"{RESPONSE_OPEN}ok {s.uid}-{j}{RESPONSE_CLOSE}" for j in range(k)) + f"answer {s.uid}<eos>"
        assert text == want
        assert s.finished and len(s.observations) == k
        mask = s.loss_mask()
        # Exactly the answers are masked: the model's tokens are trained, the tools' never.
        masked = decode(s.response_tokens[mask == 0])
        assert masked == "".join(f"{RESPONSE_OPEN}ok {s.uid}-{j}{RESPONSE_CLOSE}" for j in range(k))
        assert np.all(s.logprobs[mask == 0] == 0.0) and np.all(s.logprobs[mask == 1] == -0.5)
        assert sum(n for _, n in s.sampled_spans()) == int(mask.sum())
    assert tool.runs == Counter({f"{u}-{j}": 1 for u in range(4) for j in range(u % 3)})
    c = loop.counters()
    assert c["ended/eos"] == 4 and c["tools/executed"] == 3 and c["turns"] == 4 + 3


def test_limits_end_episodes_with_a_reason():
    forever = ScriptedEngine(lambda s, k: call(f"{s.uid}-{k}"))  # never answers
    loop, tool = make_loop(max_turns=3)
    g = make_group(2)
    assert run(loop.run(g, forever, 10_000, never())) is True
    assert all(s.finished and len(s.observations) == 2 for s in g.samples)
    assert loop.counters()["ended/max_turns"] == 2 and sum(tool.runs.values()) == 4

    loop, tool = make_loop(max_tool_calls=1)
    g = make_group(2)
    assert run(loop.run(g, forever, 10_000, never())) is True
    assert loop.counters()["ended/max_tool_calls"] == 2 and sum(tool.runs.values()) == 2

    # The context: prompt (2) + a call (~55 tokens) + its answer; a second call does not fit.
    one = len(encode(call("0-0"))) + len(encode(f"{RESPONSE_OPEN}ok 0-0{RESPONSE_CLOSE}"))
    loop, tool = make_loop(max_episode_tokens=2 + one + 20)
    g = make_group(1)
    assert run(loop.run(g, forever, 10_000, never())) is True
    s = g.samples[0]
    assert s.finished and s.n_prompt + s.n_response <= 2 + one + 20
    assert loop.counters()["ended/max_episode_tokens"] == 1

    loop, _ = make_loop()
    g = make_group(1)
    assert run(loop.run(g, forever, 40, never())) is True  # the response cap binds first
    assert g.samples[0].n_response == 40 and loop.counters()["ended/max_response_len"] == 1


def test_malformed_and_failing_calls_answer_with_errors_and_the_episode_goes_on():
    def boom(key: str) -> str:
        raise RuntimeError("no such key")

    scripts = {
        0: ["<tool_call>{not json</tool_call>", "done"],
        1: ['<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "done"],
        2: ["stray </tool_call>", "done"],
        3: [call("x", name="boom"), "done"],
    }
    loop, _ = make_loop(extra=[Tool("boom", boom, 5.0)])
    eng = ScriptedEngine(lambda s, k: scripts[s.uid][k])
    g = make_group(4)
    assert run(loop.run(g, eng, 10_000, never())) is True
    answers = [decode(s.response_tokens[s.loss_mask() == 0]) for s in g.samples]
    assert "error: not a tool call: not JSON" in answers[0]
    assert "error: no tool named 'nope'" in answers[1]
    assert "error: not a tool call: </tool_call> without <tool_call>" in answers[2]
    assert "error: RuntimeError: no such key" in answers[3]
    assert all(decode(s.response_tokens).endswith("done<eos>") for s in g.samples)
    c = loop.counters()
    assert c["tools/error/malformed"] == 2 and c["tools/error/unknown_tool"] == 1 and c["tools/error/raised"] == 1


@pytest.mark.parametrize("when", ["mid_turn", "tool_running"])
def test_an_abort_keeps_finished_turns_and_no_call_runs_twice(when):
    """A sync that aborts lands mid-turn or while a tool runs. Mid-turn, the episode stops at
    the turn boundary; waiting on a tool, at once: the call goes on through the sync, and the
    resumed episode takes its answer. No answer is lost, no call made twice."""
    tool = Counting(delay_s=0.3 if when == "tool_running" else 0.05)
    loop, _ = make_loop(tool=tool)
    eng = ScriptedEngine(calls_then_answer(lambda uid: 3), tick_s=0.001)
    g = make_group(4)
    cut = asyncio.Event()

    async def main():
        task = asyncio.create_task(loop.run(g, eng, 10_000, cut))
        if when == "tool_running":
            while not loop.box._running:
                await asyncio.sleep(0.001)
        else:
            while not any(s.n_response > 5 for s in g.samples):
                await asyncio.sleep(0.001)
        cut.set()
        await eng.abort_all()
        first = await task
        running = len(loop.box._running)
        kept = [s.n_response for s in g.samples]
        cut.clear()
        second = await loop.run(g, eng, 10_000, cut)
        return first, running, kept, second

    first, running, kept, second = run(main())
    assert first is False and second is True
    if when == "tool_running":
        assert running > 0, "the cut waited for the tools"
    for s in g.samples:
        assert decode(s.response_tokens).endswith(f"answer {s.uid}<eos>") and len(s.observations) == 3
        # No answer is lost: each of the 3 calls has its answer right after it.
        assert decode(s.response_tokens).count(RESPONSE_OPEN) == 3
    assert tool.runs == Counter({f"{u}-{j}": 1 for u in range(4) for j in range(3)})


def test_a_pending_call_is_answered_from_the_record_after_a_checkpoint():
    """A copy of an episode taken after its call and before the answer reached it (what a
    process that did not see the answer holds), resumed by a loop restored from a checkpoint,
    is answered from the record: the tool is not called again."""
    tool = Counting()
    loop, _ = make_loop(tool=tool)
    eng = ScriptedEngine(calls_then_answer(lambda uid: 1))
    g = make_group(1)
    assert run(loop.run(g, eng, 10_000, never()))
    s = g.samples[0]
    n = int(np.flatnonzero(s.response_tokens == CALL_END)[0]) + 1
    copy = Sample(s.uid, s.prompt_id, s.index, s.n_prompt, s.prompt_tokens, s.response_tokens[:n], s.logprobs[:n], n, [[0, n]])
    assert decode(copy.response_tokens).endswith("</tool_call>") and not copy.finished
    state = json.loads(json.dumps(loop.state()))  # what a checkpoint keeps
    again, _ = make_loop(tool=tool)
    again.restore(state)
    assert run(again.run(Group(0, [copy], 0, 0.0), eng, 10_000, never())) is True
    assert tool.runs == Counter({"0-0": 1}) and again.counters()["tools/replayed"] == 1
    assert decode(copy.response_tokens) == decode(s.response_tokens)


def test_a_lost_engine_stops_every_episode_of_the_group():
    class Lost(Exception):
        pass

    class Dies(ScriptedEngine):
        async def _one(self, s, cap, stop_ids):
            if s.index == 0 and len(s.observations) == 1:
                raise Lost()
            return await super()._one(s, cap, stop_ids)

    loop, tool = make_loop()
    eng = Dies(calls_then_answer(lambda uid: 3), tick_s=0.001)
    g = make_group(3)

    async def main():
        with pytest.raises(Lost):
            await loop.run(g, eng, 10_000, never())
        before = [s.n_response for s in g.samples]
        await asyncio.sleep(0.1)
        return before

    before = run(main())
    assert [s.n_response for s in g.samples] == before, "no sibling writes after the loss"


def test_forget_drops_the_records_of_episodes_that_ended():
    loop, _ = make_loop()
    eng = ScriptedEngine(calls_then_answer(lambda uid: 2))
    a, b = make_group(2, 0), make_group(2, 1)
    run(loop.run(a, eng, 10_000, never()))
    run(loop.run(b, eng, 10_000, never()))
    assert len(loop.box.record) == 8
    loop.forget([a])
    assert sorted(cid.rsplit(":", 1)[0] for cid in loop.box.record) == sorted(f"{u}:{k}:0" for u in (2, 3) for k in range(2))


def test_a_call_whose_caller_is_cancelled_runs_once_and_is_recorded():
    """The episode waiting on a call is cancelled (its group's engine was lost): the call goes
    on and is recorded; asked again while it runs, it is waited for, not made twice."""
    from core.agent.tool_call import parse_calls

    tool = Counting(delay_s=0.2)
    box = ToolBox([Tool("count", tool, 5.0)])
    calls = parse_calls(call("k"), 7, 0)

    async def main():
        first = asyncio.ensure_future(box.answer(calls))
        await asyncio.sleep(0.05)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        again = await box.answer(calls)
        after = await box.answer(calls)
        return again, after

    again, after = run(main())
    assert tool.runs == Counter({"k": 1})
    assert again[0].content == after[0].content == "ok k"
    assert box.counts["joined"] == 1 and box.counts["replayed"] == 1 and list(box.record) == [calls[0].id]


def test_the_journal_answers_calls_made_after_the_checkpoint_a_run_goes_back_to(tmp_path):
    """A run rolled back to a checkpoint (a resume, a restarted rollout actor) makes its turns
    again: a call that comes out as it was is answered from the journal; one that comes out
    different is another call, and is made."""
    from core.agent.tool_call import parse_calls
    from core.store.tool_journal import ToolJournal

    path = tmp_path / "tools.journal"
    tool = Counting()
    box = ToolBox([Tool("count", tool, 5.0)], journal=ToolJournal(path))
    run(box.answer(parse_calls(call("a"), 1, 0)))
    checkpoint = box.state()
    after = parse_calls(call("b") + call("c"), 2, 0)
    made = run(box.answer(after))
    box.close()

    # Another process that starts over without a checkpoint's state (the run's only one was
    # taken before anything ran): it answers from the whole journal.
    fresh = ToolBox([Tool("count", tool, 5.0)], journal=ToolJournal(path))
    assert run(fresh.answer(after)) == made and tool.runs == Counter({"a": 1, "b": 1, "c": 1})
    fresh.close()

    # Another process, from the checkpoint.
    again = ToolBox([Tool("count", tool, 5.0)], journal=ToolJournal(path))
    again.restore(checkpoint)
    assert run(again.answer(after)) == made
    assert run(again.answer(parse_calls(call("a"), 1, 0)))[0].content == "ok a"
    different = parse_calls(call("b2") + call("c"), 2, 0)  # turn 0 of episode 2, generated otherwise
    assert [r.content for r in run(again.answer(different))] == ["ok b2", "ok c"]
    assert tool.runs == Counter({"a": 1, "b": 1, "c": 1, "b2": 1})
    assert again.counts["replayed"] == 4 and again.counts["executed"] == 1 + 1  # a (before) and b2
    # Its own state counts what it appended: a later checkpoint's journal position.
    assert again.state()["journal_records"] == 4


def test_a_torn_last_tool_record_is_ignored_and_a_corrupt_one_named(tmp_path):
    from core.agent.tool_call import parse_calls
    from core.store.checkpoint import CheckpointError
    from core.store.journal_file import FRAME
    from core.store.tool_journal import ToolJournal

    path = tmp_path / "tools.journal"
    box = ToolBox([Tool("count", Counting(), 5.0)], journal=ToolJournal(path))
    run(box.answer(parse_calls(call("a") + call("b"), 1, 0)))
    box.close()
    whole = path.read_bytes()
    path.write_bytes(whole[:-3])  # the second write cut short by a crash
    (kept,) = ToolJournal(path).since(0)  # the two calls ran at once: either was written first
    assert kept["content"] in ("ok a", "ok b")
    body = b'{"kind": "asyncrl.tool-result/1", "id": 3}'
    path.write_bytes(whole + FRAME.pack(len(body)) + body)
    with pytest.raises(CheckpointError, match=f"byte {len(whole)}: tool result unreadable"):
        ToolJournal(path).since(0)


def test_a_tool_that_takes_call_id_is_given_the_calls_id_and_the_model_cannot_set_it():
    from core.agent.tool_call import parse_calls

    seen = []

    def keyed(key: str, call_id: str) -> str:
        seen.append(call_id)
        return f"ok {key}"

    box = ToolBox([Tool("count", keyed, 5.0)])
    calls = parse_calls(call("a"), 4, 1)
    assert run(box.answer(calls))[0].content == "ok a" and seen == [calls[0].id]
    forged = parse_calls('<tool_call>{"name": "count", "arguments": {"key": "x", "call_id": "4:1:0:0"}}</tool_call>', 4, 2)
    (r,) = run(box.answer(forged))
    assert r.error == "bad_arguments" and "call_id" in r.content and seen == [calls[0].id]
