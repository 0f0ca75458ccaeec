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


def command_line(main) -> int:
    """``main()`` as a command: an exception no check foresaw (a bug, a disk that fills up) ends
    in one ``error:`` line, its traceback kept in a new file for a report, and exit code 1."""
    try:
        return main()
    except Exception as exc:  # KeyboardInterrupt and SystemExit are the command's own
        sys.stderr.write(f"error: {unforeseen(exc)}\n")
        return 1


def unforeseen(exc: BaseException) -> str:
    """The line for ``exc``; its traceback goes to a file created anew in the temp directory."""
    import tempfile
    import traceback

    if isinstance(exc, OSError) and exc.errno is not None and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror} ({type(exc).__name__}); fix: check that path: the space left on its disk, its permissions"
    what = first_line(exc)
    fd, path = tempfile.mkstemp(prefix="asyncrl-traceback-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.write("".join(traceback.format_exception(exc)))
    frames = traceback.extract_tb(exc.__traceback__)
    where = frames[-1].filename if frames else ""
    if where and not os.path.relpath(where).startswith(".."):
        where = os.path.relpath(where)  # the project's own files, as the repository names them
    at = f" at {where}:{frames[-1].lineno}" if frames else ""
    return f"asyncrl failed ({what}{at}), which no check of its input foresaw; fix: report it with the traceback in {path}"


def first_line(exc: BaseException) -> str:
    """``Type: message``, the message's first line and at most 200 characters of it: an exception in an error line."""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
