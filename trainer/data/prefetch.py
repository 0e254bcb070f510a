"""Work done on threads a few items ahead of its consumer, handed over in order (Encode Images' decoding).

Decoding a photo and resizing it to each of its buckets is Pillow's C code, which releases the GIL, so
threads run it in parallel while the caller keeps the encoder calls and the cache writes in the plan's
order: the latents, the cache and the problems named are a one-thread run's (bench/RESULTS.md)."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

Job, Result = TypeVar("Job"), TypeVar("Result")

# Threads for decoding: the machine's cores, at most this many (each holds a decoded photo: 36 MB at 12 MP).
MAX_WORKERS = 8


def workers() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_WORKERS, cores))


def in_order(jobs: Iterable[Job], work: Callable[[Job], Result], threads: int | None = None) -> Iterator[Result]:
    """work(job) for every job, yielded in the jobs' order; at most `threads` jobs run or wait unconsumed at a
    time, so memory stays bounded however many jobs there are. One thread: no pool, plain calls. An exception
    in `work` is raised where its result would have been yielded."""
    threads = workers() if threads is None else threads
    if threads <= 1:
        yield from map(work, jobs)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="kiln-decode") as pool:
        ahead: deque = deque()
        try:
            for job in jobs:
                ahead.append(pool.submit(work, job))
                if len(ahead) >= threads:
                    yield ahead.popleft().result()
            while ahead:
                yield ahead.popleft().result()
        finally:  # a consumer that stops early (an error, a closed generator): drop what has not started
            for future in ahead:
                future.cancel()
