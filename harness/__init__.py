"""The harness: scenarios in, reports out (run, calibrate, sweeps, metrics, reports, loggers)."""

import os
import signal
import sys


def _interrupted_while_starting(signum, frame) -> None:
    os.write(2, b"interrupted while starting; nothing was run\n")  # not through sys.stderr, which a library may have replaced
    os._exit(130)


def starting() -> None:
    """Until ``started()``, Ctrl-C ends the process in one line and exit 130, not in a traceback
    from inside whatever import was loading (torch and Ray take seconds). A SIGINT the shell
    ignores stays ignored."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted_while_starting)


# ``python -m harness.X`` imports this package first, while sys.argv[0] is still "-m"; the
# command's main() hands Ctrl-C back to Python (``started``) once it has something to clean up.
if sys.argv[:1] == ["-m"]:
    starting()


def started() -> None:
    """The command's imports are done: Ctrl-C raises KeyboardInterrupt again, which it handles."""
    if signal.getsignal(signal.SIGINT) is _interrupted_while_starting:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def command_line(main) -> int:
    """``main()`` as a command: an exception no check foresaw (a bug, a disk that fills up) ends
    in one ``error:`` line, its traceback kept in a new file for a report, and exit code 1;
    Ctrl-C in one line and exit code 130."""
    try:
        return main()
    except KeyboardInterrupt:  # a command says what Ctrl-C left where it can; this is the fallback
        sys.stderr.write("interrupted\n")
        return 130
    except Exception as exc:  # SystemExit is the command's own
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
