"""The generation service of one process: a decoder, its batch thread and metrics, and what
starts, checks and stops them. The HTTP routes (`app`) are a view on it; the same service runs
under uvicorn (`http`, `specdec serve`) and in a Ray Serve replica (`replicas`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace

from specdec.api import Generation, SpeculativeDecoder
from specdec.errors import SpecDecError
from specdec.policy import BatchDepth
from specdec.scopes import KeyScope
from specdec.server.batch import Batcher, Job, Metrics
from specdec.server.openai import BadRequest, CompletionRequest, SamplingFields

STALL_SECONDS = 120.0  # a batch with work that has not finished a round for this long is wedged


@dataclass(frozen=True)
class Health:
    """How the batch is: "ok", "shutting down", or "unhealthy: <why>" (its thread is dead or wedged),
    with the work it holds."""

    status: str
    queue_depth: int
    batch_size: int
    stalled_seconds: float | None = None  # only when unhealthy: seconds without beginning a round

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def unhealthy(self) -> bool:
        return self.stalled_seconds is not None


def batch_depth(decoder: SpeculativeDecoder) -> BatchDepth | None:
    """A batch-wide depth cap for a decoder with a fixed gamma (None when it does not draft, or
    when its own cost-aware policy adapts each row to the batch)."""
    if decoder.drafter is None or decoder.uses_profile:
        return None
    return decoder.depth_policy(BatchDepth, decoder.gamma)


class Service:
    """Continuous batching over one decoder, started at construction, its cost profile read first
    so that no request waits for it. Acceptance is carried across requests where the decoder was
    made to share it (`share_acceptance`, as a server's builder makes it).

    depth, for a decoder with a fixed gamma: "measure" caps each step's draft depth by the batch
    size from measured forward costs (`batch_depth`), None: always the decoder's gamma. (The
    default, cost-aware policy sizes each row's draft for the batch itself.)"""

    def __init__(self, decoder: SpeculativeDecoder, model_name: str, max_queue: int = 16, max_batch: int = 16,
                 depth: BatchDepth | None | str = "measure", stall_seconds: float = STALL_SECONDS):
        self.decoder, self.model_name, self.stall_seconds = decoder, model_name, stall_seconds
        self.max_queue = max_queue  # requests that may wait, and long texts that may wait to be tokenized
        self.created = int(time.time())
        self.metrics = Metrics()
        decoder.prepare()  # a decoder made with prepare=False reads its profile now, not in a request
        self.batcher = Batcher(decoder, max_batch, max_queue, self.metrics,
                               batch_depth(decoder) if depth == "measure" else depth)

    # ------------------------------------------------------------------ requests
    def generations(self, body: SamplingFields, encode, param: str, key: int | None = None) -> list[Generation]:
        """The request's `n` generations (its choices), everything checked (a BadRequest otherwise). The request is
        checked by `SpeculativeDecoder.request` (its SpecDecError names the field); only what is the
        server's own is checked here: max_tokens within the context left (the API caps it instead).
        `encode()` gives its prompt's token ids, `param` names the field they came from. key: which
        of the server's API keys the request came with (None: no keys, or one scope for all keys):
        with the body's `cache_salt`, its scope (`specdec.scopes`); `user` narrows its history within that.
        Choice i of a seeded request draws with seed + i: n rows of the batch, each its own sample."""
        decoder = self.decoder
        try:
            ids = encode()
        except SpecDecError as error:
            raise BadRequest(str(error), param=param) from None
        except Exception as error:  # text the tokenizer cannot take, e.g. a lone surrogate
            raise BadRequest(f"the {param} cannot be tokenized: {type(error).__name__}", param=param) from None
        room = decoder.target.max_length - len(ids)
        if body.max_tokens is None:
            body.max_tokens = min(16, room) if isinstance(body, CompletionRequest) else room
        if body.max_tokens > room:
            raise BadRequest(f"max_tokens {body.max_tokens} plus the prompt's {len(ids)} tokens exceed the context of "
                             f"{decoder.target.max_length}", param="max_tokens")
        scope = None if key is None and body.cache_salt is None else KeyScope(key, body.cache_salt)
        try:
            sampling, limits, constraint = body.sampling(), body.limits(), body.constraint()
            return [decoder.request(ids, replace(sampling, seed=None if sampling.seed is None else sampling.seed + i),
                                    limits, prediction=body.predicted_text(), tenant=body.user, scope=scope,
                                    constraint=constraint)
                    for i in range(body.n)]
        except SpecDecError as error:
            raise BadRequest(str(error), param=error.param) from None

    def check_room(self) -> None:
        """Refuse (QueueFull, ShuttingDown) a request that could not wait now; `submit` checks again."""
        self.batcher.check_room()

    def submit(self, generation: Generation) -> Job:
        """Queue a generation (QueueFull, ShuttingDown: it cannot); its events arrive on the running event loop."""
        job = Job(generation, asyncio.get_running_loop())
        self.batcher.submit(job)
        return job

    def cancel(self, job: Job) -> None:
        """The client left or its handler ended: the batch stops working for the job (see Batcher.cancel)."""
        self.batcher.cancel(job)

    # ------------------------------------------------------------------ life
    def health(self) -> Health:
        """Ok while the batch makes progress; not while shutting down (a load balancer takes the server
        out of rotation), nor when the batch thread is dead or wedged (unhealthy)."""
        batcher = self.batcher
        busy = {"queue_depth": len(batcher.waiting), "batch_size": len(batcher.running)}
        if batcher.closing:
            return Health("shutting down", **busy)
        stalled = batcher.stalled_for()
        if not batcher.thread.is_alive() or stalled > self.stall_seconds:
            return Health("unhealthy: the batch is not making progress", **busy, stalled_seconds=round(stalled, 1))
        return Health("ok", **busy)

    def drain(self, timeout: float) -> None:
        """Refuse new requests, let running ones finish for up to `timeout` seconds (see Batcher.shut_down)."""
        self.batcher.shut_down(timeout)

    def stop_now(self) -> None:
        self.batcher.stop_now()
