"""Long texts tokenized fairly: each API key's in a lane of its own, the lanes served in turn.

A prompt or a prediction of hundreds of kilobytes takes a tokenizer tenths of a second to seconds.
Tokenized one after another on one thread, 24 such predictions from one client made another
client's request wait 6.9 s; tokenized side by side, they took the batch's cores. Here at most
`workers` texts are tokenized at once and at most one of each key, so one key's texts hold one
thread while another key's start at once; a key waits at most its turn behind the other keys with
work, never behind a queue of another key's texts. What is held is bounded (`limit`, and half of it
per key): more is refused (QueueFull, a 429) before anything is tokenized.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Hashable, TypeVar

from specdec.server.batch import QueueFull

T = TypeVar("T")
WORKERS = 2  # texts tokenized at once: one key's take one thread, another key's the other
NICENESS = 10  # the lanes' threads yield the cores to the batch's steps and the event loop


def _yield_to_the_batch() -> None:
    """Lower this thread's scheduling priority (Linux: a thread is a task with a niceness of its
    own), so that tokenizing long texts never slows the steps of the generations already running."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)
    except (AttributeError, OSError):  # no per-thread priorities here: the lanes still bound the threads
        pass


class FairLanes:
    """Runs blocking work (tokenizing a long text) on `workers` threads, one lane per key.

    Invariants: every item of a key runs in arrival order, at most one at a time; a thread that
    frees takes the first lane in turn that has no item running, and a key whose item ends goes
    behind every key waiting then; at most `limit` items are held
    (waiting or running), at most `per_key` of one key (default: half of `limit`). All bookkeeping
    runs on the event loop's thread, so it needs no lock."""

    def __init__(self, workers: int = WORKERS, limit: int = 64, per_key: int | None = None):
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="specdec-tokenize",
                                       initializer=_yield_to_the_batch)
        self.workers, self.limit = workers, limit
        self.per_key = per_key or max(1, limit // 2)
        self.lanes: dict[Hashable, deque] = {}  # keys with work waiting, in the order of their turns
        self.running: set[Hashable] = set()
        self.held: dict[Hashable, int] = {}  # items of each key waiting or running

    async def run(self, key: Hashable, work: Callable[[], T]) -> T:
        """`work()`'s result (or its exception), once its turn comes. QueueFull when too much is held.
        Cancelled while it waits (its client left), the work never runs."""
        if sum(self.held.values()) >= self.limit:
            raise QueueFull(f"the server is busy: {self.limit} long texts are already waiting to be tokenized")
        if self.held.get(key, 0) >= self.per_key:
            raise QueueFull(f"the server is busy: this key already has {self.per_key} long texts waiting to be "
                            "tokenized")
        future = asyncio.get_running_loop().create_future()
        self.lanes.setdefault(key, deque()).append((work, future))
        self.held[key] = self.held.get(key, 0) + 1
        self._dispatch()
        return await future

    def _dispatch(self) -> None:
        """Start the next item of each lane in turn whose key has none running, while threads are free."""
        loop = asyncio.get_running_loop()
        while len(self.running) < self.workers:
            ready = [k for k in self.lanes if k not in self.running]  # a key may be None (a server without keys)
            if not ready:
                return
            key = ready[0]
            lane = self.lanes.pop(key)
            work, future = lane.popleft()
            if lane:
                self.lanes[key] = lane  # its next item waits for the key's next turn, after the others'
            if future.cancelled():
                self._release(key)
                continue
            self.running.add(key)
            loop.run_in_executor(self.pool, work).add_done_callback(
                lambda done, key=key, future=future: self._finished(key, future, done))

    def _finished(self, key: Hashable, future: asyncio.Future, done: asyncio.Future) -> None:
        self.running.discard(key)
        self._release(key)
        if key in self.lanes:  # its turn is over: behind every key that waited meanwhile
            self.lanes[key] = self.lanes.pop(key)
        if not future.cancelled():
            if done.exception() is not None:
                future.set_exception(done.exception())
            else:
                future.set_result(done.result())
        self._dispatch()

    def _release(self, key: Hashable) -> None:
        self.held[key] -= 1
        if not self.held[key]:
            del self.held[key]
