"""The harness: scenarios in, reports out (run, calibrate, sweeps, metrics, reports, loggers)."""

import os
import signal
import sys


def _interrupted_while_starting(signum, frame) -> None:
    sys.stderr.write("interrupted while starting; nothing was run\n")
    os._exit(130)


# ``python -m harness.X`` imports this package first, while sys.argv[0] is still "-m". Ctrl-C
# while the command's imports load (torch and Ray take seconds) then ends in one line and exit
# 130, not a traceback from inside some import; the command's main() hands Ctrl-C back to
# Python (``started``) before it does anything. A SIGINT the shell ignores stays ignored.
if sys.argv[:1] == ["-m"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _interrupted_while_starting)


def started() -> None:
    """The command's imports are done: Ctrl-C raises KeyboardInterrupt again, which it handles."""
    if signal.getsignal(signal.SIGINT) is _interrupted_while_starting:
        signal.signal(signal.SIGINT, signal.default_int_handler)
