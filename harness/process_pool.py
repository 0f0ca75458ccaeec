"""Independent sim runs in worker processes: a sweep's grid points, a band's draws."""

from __future__ import annotations

import multiprocessing
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
        pool.shutdown(wait=False, cancel_futures=True)  # Ctrl-C: do not start the jobs still queued
        raise
    pool.shutdown()
    return results


def _guarded(fn, *args) -> dict:
    try:
        return fn(*args)
    except Exception as exc:  # a job whose run fails is reported as failed; the others go on
        return {"error": f"{type(exc).__name__}: {exc}"}
