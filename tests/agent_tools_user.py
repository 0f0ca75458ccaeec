"""Users' tools for tests/test_agent_tools.py: one that works, and one for each way a tool fails."""

import asyncio
import time

NOT_A_FUNCTION = 3
COUNTED: dict = {}


def echo(text: str) -> str:
    return f"{text}:1"


def counted(key: str) -> str:
    COUNTED[key] = COUNTED.get(key, 0) + 1
    return f"{key} seen"


def raises() -> str:
    raise ValueError("the tool broke")


def hangs() -> str:
    time.sleep(3600)
    return "never"


async def async_hangs() -> str:
    await asyncio.sleep(3600)
    return "never"


def returns_nan() -> float:
    return float("nan")


def huge() -> str:
    return "x" * 10_000


async def async_blocks_its_loop() -> str:
    time.sleep(0.3)  # a blocking call inside an async tool: its own loop stalls, not the caller's
    return "done"


def positional_only(x, /) -> str:
    return str(x)


async def async_raises() -> str:
    await asyncio.sleep(0)
    raise RuntimeError("the async tool broke")


def calculator_counting_calls(expression: str, call_id: str) -> str:
    """The built-in calculator, and a line with the call's id appended to the file that
    ``ASYNCRL_TEST_CALL_LOG`` names, at each execution: a count of executions that no process
    of the run keeps (Ray actors restart, a resumed run is a new process)."""
    import os

    from core.agent.calculator import calculate

    with open(os.environ["ASYNCRL_TEST_CALL_LOG"], "a") as f:
        f.write(f"{call_id} {os.getpid()} {time.time():.3f}\n")  # which process, when: for a failure's message
    return calculate(expression)


def calculator_counting_slowly(expression: str, call_id: str) -> str:
    """``calculator_counting_calls`` that takes 1.5 s after it logs the call: a Ctrl-C that
    follows a new line of the log lands while that call runs."""
    answer = calculator_counting_calls(expression, call_id)
    time.sleep(1.5)
    return answer


class _Text(str):
    """A ``str`` whose methods a tool's library broke: its length and its text raise."""

    def __len__(self):
        raise RuntimeError("len of a broken str")

    def __str__(self):
        raise RuntimeError("str of a broken str")


class _Pretends:
    __class__ = str  # isinstance(x, str) says yes; nothing of a str is there


def subprocess_bytes() -> str:
    return b"ok \xff\xfe end".decode("utf-8", "surrogateescape")  # what a subprocess's raw output decodes to


def broken_str() -> str:
    return _Text("copied")


def pretends_to_be_text() -> str:
    return _Pretends()


def raises_with_a_surrogate() -> str:
    raise ValueError("bad byte \udcff here")
