"""The commands' argument parser: every argument error is one line with its fix
(``ArgumentError``), never argparse's usage and exit."""

from __future__ import annotations

import argparse
import difflib
import re
import typing

from core.model.config import clipped


class ArgumentError(ValueError):
    """A command line the command cannot take: one line, with its fix."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, with every error ``ArgumentError``. ``examples``: an example of each option that
    takes a value, for the fix; ``shape``: what the command takes, for an unknown argument."""

    def __init__(self, *args, examples: dict[str, str], shape: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.examples, self.shape = examples, shape

    def error(self, message: str) -> typing.NoReturn:
        raise ArgumentError(self._line(message))

    def _line(self, message: str) -> str:
        options = [o for a in self._actions for o in a.option_strings]
        message = clipped(" ".join(message.split()))  # a long value is echoed, never whole
        if message.startswith("unrecognized arguments: "):
            given = message.split(": ", 1)[1].split()[0]
            close = difflib.get_close_matches(given.split("=")[0], options, n=1, cutoff=0.75)
            fix = f"did you mean {close[0]}?" if close else f"drop it; the options are {', '.join(o for o in options if o.startswith('--'))}"
            return f"{given}: not an argument {self.prog} takes ({self.shape}); fix: {fix}"
        option = message[len("argument "):].split(":", 1)[0].split("/")[-1] if message.startswith("argument ") else None
        example = self.examples.get(option, "")
        e_g = f", e.g. {example}" if example else ""
        if "invalid int value" in message or "not a whole number" in message:
            return f"{message}; fix: give a whole number{e_g}"
        if "invalid float value" in message:
            return f"{message}; fix: give a number{e_g}"
        if "invalid choice" in message:
            return f"{message}; fix: give one of those{e_g}"
        if "expected one argument" in message:
            return f"{message}; fix: give it a value{e_g}"
        if "arguments are required" in message:
            return f"{message}; fix: give {self.shape}"
        return f"{message}; fix: see {self.prog} --help"


def whole_number(text: str) -> int:
    """A count given on the command line: digits, few enough to echo back in an error."""
    if re.fullmatch(r"\s*[+-]?[0-9]{1,12}\s*", text) is None:
        raise argparse.ArgumentTypeError(f"{text[:20]!r}{'...' if len(text) > 20 else ''} is not a whole number of at most 12 digits")
    return int(text)
