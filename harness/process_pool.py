"""Independent sim runs in worker processes: a sweep's grid points, a band's draws."""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any, Callable, Hashable, Iterable, Optional


def run_all(fn: Callable[..., dict], jobs: Iterable[tuple[Hashable, tuple]], workers: int,
            on_done: Optional[Callable[[Hashable], Any]] = None) -> dict[Hashable, dict]:
    """``fn(*args)`` for each ``(key, args)``, ``workers`` at a time in spawned processes (one
    worker: in this process). Returns key -> its answer, or {"error": text} where it raised: one
    failed job is reported, the others go on."""
    todo = list(jobs)
    results: dict[Hashable, dict] = {}
    workers = min(workers, len(todo))
    if workers <= 1:
        for key, args in todo:
            results[key] = _guarded(fn, *args)
            if on_done:
                on_done(key)
        return results
    # spawn, not fork: a forked child would inherit the parent's threads and locks (rich's refresher).
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        with _deaf_children():  # the workers start in submit
            running: dict[Future, Hashable] = {pool.submit(fn, *args): key for key, args in todo}
        while running:
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                key = running.pop(fut)
                exc = fut.exception()
                results[key] = {"error": f"{type(exc).__name__}: {exc}"} if exc else fut.result()
                if on_done:
                    on_done(key)
    except BaseException:
        # Ctrl-C: the jobs still queued never start, and those running stop now.
        for proc in list((getattr(pool, "_processes", None) or {}).values()):
            proc.terminate()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return results


def _guarded(fn, *args) -> dict:
    try:
        return fn(*args)
    except Exception as exc:  # a job whose run fails is reported as failed; the others go on
        return {"error": f"{type(exc).__name__}: {exc}"}


@contextlib.contextmanager
def _deaf_children():
    """Processes started inside inherit SIGINT blocked. A terminal's Ctrl-C goes to the whole
    process group: this process answers it in one line and stops the workers, where each would
    print its own KeyboardInterrupt traceback (a blocked signal stays blocked across exec)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
