"""Continuous batching: one thread advances every running generation together, step by step."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specdec.api import Generation, GenerationResult, SpeculativeDecoder
from specdec.policy import BatchDepth
from specdec.types import GenerationStats


class Refused(Exception):
    """A request the batch cannot take now; the message says why."""


class QueueFull(Refused):
    """`max_queue` requests already wait."""


class ShuttingDown(Refused):
    """The batch has begun to shut down: it takes no new requests."""


# What the batch thread tells a job's reader: Deltas, then one of the others (none once the client has left).
@dataclass(frozen=True)
class Delta:
    """New text, and the logprobs of the tokens whose text went out with it (None: the request wants none)."""

    text: str
    logprobs: list | None


@dataclass(frozen=True)
class Done:
    """The generation finished; its result."""

    result: GenerationResult


@dataclass(frozen=True)
class Failed:
    """The generation ended by an error of its own or of the batch's forward."""

    message: str


@dataclass(frozen=True)
class Unavailable:
    """The batch shut down before the generation finished (or began)."""

    message: str


Event = Delta | Done | Failed | Unavailable


@dataclass(eq=False)  # a job is itself: found in the queues by identity
class Job:
    """One request: the batch thread puts its Events in `events`; the request handler reads them."""

    generation: Generation
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)
    last_token: float | None = None  # when the last text delta went out
    logprobs_sent: int = 0  # tokens whose logprobs went out with a delta

    def emit(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass


class Batcher:
    """Continuous batching on one thread: every running generation advances by one engine step
    at a time, all rows in one target forward. Between steps, waiting jobs join (up to `max_batch`
    run at once) and finished or cancelled ones leave at once. A joining job's prompt is prefilled
    one chunk (`engine.PREFILL_CHUNK` tokens) a round, the joining jobs taking turns, before it is
    stepped: a long prompt delays the others' steps by one chunk's forward, and the prompts that
    join after it by their own chunks' turns, never by its whole prefill. At most `max_queue` jobs
    wait; `submit` refuses beyond that. The draft depth of a step comes from `depth` (a BatchDepth)."""

    def __init__(self, decoder: SpeculativeDecoder, max_batch: int, max_queue: int, metrics: "Metrics",
                 depth: BatchDepth | None):
        self.metrics, self.max_batch, self.max_queue, self.depth = metrics, max_batch, max_queue, depth
        self.engine = decoder.engine()
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.prefilling: deque[Job] = deque()  # running jobs whose prompt is not all in, in turn
        self.changed = threading.Condition()
        self.closing: str | None = None  # why new requests are refused (shutting down)
        # when the batch thread last began a round with work, or work arrived at an idle batch
        self.beat = time.monotonic()
        metrics.queue_depth.set_function(lambda: len(self.waiting))
        metrics.batch_size.set_function(lambda: len(self.running))
        if self.engine.prefixes is not None:
            metrics.kept.set_function(lambda: self.engine.prefixes.tokens)
        self.thread = threading.Thread(target=self._run, name="specdec-batch", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        with self.changed:
            self.check_room()
            if not self.waiting and not self.running:
                self.beat = time.monotonic()
            self.waiting.append(job)
            self.changed.notify()

    def check_room(self) -> None:
        """Refuse a request that could not wait now: ShuttingDown first, then QueueFull."""
        if self.closing:
            raise ShuttingDown(self.closing)
        if len(self.waiting) >= self.max_queue:
            raise QueueFull(f"the server is busy: {self.max_queue} requests are already waiting")

    def stalled_for(self) -> float:
        """Seconds the batch has had work without beginning a round (0 when it has none)."""
        return time.monotonic() - self.beat if self.waiting or self.running else 0.0

    def cancel(self, job: Job) -> None:
        """The client left: a waiting job leaves the queue now, a running one at the next step."""
        if job.cancelled.is_set():
            return
        job.cancelled.set()
        with self.changed:
            if job in self.waiting:
                self.waiting.remove(job)
                self.metrics.cancelled.inc()
            self.changed.notify()

    def shut_down(self, timeout: float) -> None:
        """Refuse new requests, end the waiting ones with an error, let the running ones finish
        for up to `timeout` seconds, then end them with an error too. Returns when all have ended."""
        with self.changed:
            self.closing = "the server is shutting down"
            while self.waiting:
                self.waiting.popleft().emit(Unavailable("the server is shutting down"))
            self.changed.notify()
        self.thread.join(timeout)
        self.stop_now()
        self.thread.join(5)

    def stop_now(self) -> None:
        """End every running job at the next step, with an error; returns at once."""
        with self.changed:
            self.closing = "the server has shut down"
            self.changed.notify()

    def _run(self) -> None:
        while True:
            try:
                if self._round():
                    return
            except Exception as error:  # never let the batch thread die: end what is running, go on serving
                for job in list(self.running):
                    self._abandon(job, _describe(error))

    def _abandon(self, job: Job, message: str) -> None:
        """End a job after an unexpected failure, whatever state its slots are in."""
        if job in self.running:
            self.running.remove(job)
        if job in self.prefilling:
            self.prefilling.remove(job)
        try:
            self.engine.close(job.generation.state, failed=True)
        except Exception:
            pass  # its slots are lost; the other jobs go on
        self.metrics.failed.inc()
        job.emit(Failed(message))

    def _round(self) -> bool:
        """Admit waiting jobs, retire cancelled ones, step once. Returns True when shut down."""
        with self.changed:
            while not self.waiting and not self.running and not self.closing:
                self.changed.wait()
            self.beat = time.monotonic()
            admitted = []
            while self.waiting and len(self.running) + len(admitted) < self.max_batch:
                admitted.append(self.waiting.popleft())
            stopping = self.closing == "the server has shut down"
        for job in admitted:
            self._open(job)
        for job in [job for job in self.running if job.cancelled.is_set() or stopping]:
            self._retire(job, Unavailable("the server shut down before the generation finished") if stopping else None)
        self._prefill()
        ready = [job for job in self.running if job not in self.prefilling]
        if ready:
            self._step(ready)
        return not self.running and self.closing is not None

    def _open(self, job: Job) -> None:
        self.running.append(job)  # from here on, a failure anywhere ends it with the others (see _run)
        try:
            job.generation.open(self.engine, prefill=False)
        except Exception as error:  # never let one request take the batch down
            self._abandon(job, _describe(error))
            return
        if job.generation.done:  # nothing to generate (max_tokens 0)
            self._retire(job, Done)
        else:
            self.prefilling.append(job)

    def _prefill(self) -> None:
        """One chunk of the next joining job's prompt; it goes to the back of the line if more is left."""
        if not self.prefilling:
            return
        job = self.prefilling.popleft()
        try:
            if not self.engine.prefill(job.generation.state):
                self.prefilling.append(job)
        except Exception as error:  # its slots are closed; the others go on
            self._abandon(job, _describe(error))

    def _step(self, jobs: list[Job]) -> None:
        states = [job.generation.state for job in jobs]
        cap = self.depth.depth(len(states)) if self.depth is not None else None
        self.metrics.step(len(states), cap)
        try:
            results = self.engine.step(states, cap)
        except Exception as error:  # a failed shared forward leaves every row's cache unknown: end them all
            for job in jobs:
                self._abandon(job, _describe(error))
            return
        now = time.perf_counter()
        for job, result in zip(jobs, results):
            if result.error is not None:  # this row's own drafting or verification failed
                self._abandon(job, _describe(result.error))
                continue
            if self.depth is not None:
                self.depth.observe(result.drafted, result.accepted)
            try:
                delta = job.generation.add(result)
                logprobs = self._new_logprobs(job) if delta else None
            except Exception as error:  # its text could not be made
                self._abandon(job, _describe(error))
                continue
            if delta:
                self.metrics.token_latency(job, now, len(result.tokens))
                job.emit(Delta(delta, logprobs))
            if job.generation.done:
                self._retire(job, Done)

    @staticmethod
    def _new_logprobs(job: Job) -> list | None:
        """The logprobs of tokens whose text has gone out since the last delta (None: the request
        wants none). A token whose text is held back waits: a stop string may still cut it."""
        if job.generation.state.logprobs is None:
            return None
        text = job.generation.text
        settled = text.settled()
        new, job.logprobs_sent = text.logprobs[job.logprobs_sent : settled], max(job.logprobs_sent, settled)
        return new

    def _retire(self, job: Job, told: Unavailable | type[Done] | None) -> None:
        """The job leaves the batch; its slots go back, and what its policy learnt goes to the
        next requests (`DraftPolicy.finish`). told: what the client is told (Done: its result; None: it left)."""
        self.engine.close(job.generation.state)
        job.generation.state.gamma_policy.finish()
        self.running.remove(job)
        if job in self.prefilling:
            self.prefilling.remove(job)
        if told is None:
            self.metrics.cancelled.inc()
        elif isinstance(told, Unavailable):
            job.emit(told)
        else:
            result = job.generation.result()
            self.metrics.record(result.stats, time.perf_counter() - job.arrived)
            job.emit(Done(result))


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


class Metrics:
    """Prometheus counters, gauges and histograms, in a registry of this app's own."""

    LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("specdec_requests", "HTTP requests to the generation endpoints, by status",
                                ["endpoint", "status"], registry=registry)
        self.generated = Counter("specdec_generated_tokens", "tokens generated", registry=registry)
        self.cached = Counter("specdec_cached_prompt_tokens",
                              "prompt tokens whose cache an earlier request had computed (prefix reuse)",
                              registry=registry)
        self.kept = Gauge("specdec_prefix_cache_tokens", "tokens of finished requests kept for prefix reuse",
                          registry=registry)
        self.cancelled = Counter("specdec_cancelled", "generations cancelled because the client left",
                                 registry=registry)
        self.failed = Counter("specdec_failed", "generations ended by an error of their own or of the batch's forward",
                              registry=registry)
        self.queue_depth = Gauge("specdec_queue_depth", "requests waiting for the model", registry=registry)
        self.batch_size = Gauge("specdec_batch_size", "generations running in the batch", registry=registry)
        self.acceptance = Gauge("specdec_acceptance_rate", "accepted / drafted over all generations", registry=registry)
        self.tokens_per_second = Gauge("specdec_tokens_per_second",
                                       "generated tokens / generation seconds, summed over generations "
                                       "(a per-generation speed; aggregate throughput is the rate of "
                                       "specdec_generated_tokens)", registry=registry)
        self.tokens_per_forward = Gauge("specdec_tokens_per_target_forward",
                                        "generated tokens / target forwards over all generations", registry=registry)
        self.time_to_first_token = Histogram("specdec_time_to_first_token_seconds", "arrival to the first text delta",
                                             buckets=self.LATENCY_BUCKETS, registry=registry)
        self.inter_token_latency = Histogram("specdec_inter_token_latency_seconds",
                                             "time between text deltas of a stream, per token",
                                             buckets=self.LATENCY_BUCKETS, registry=registry)
        self.batch_rows = Histogram("specdec_batch_rows", "generations advanced per engine step",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=registry)
        self.draft_tokens = Counter("specdec_draft_tokens",
                                    "draft tokens that verification reached, by source (the default drafter's)",
                                    ["source"], registry=registry)
        self.accepted_draft_tokens = Counter("specdec_accepted_draft_tokens",
                                             "draft tokens accepted, by source (the default drafter's); "
                                             "with specdec_draft_tokens_total, each source's acceptance", ["source"],
                                             registry=registry)
        self.draft_depth = Gauge("specdec_draft_depth",
                                 "the batch-wide draft depth cap of the last step "
                                 "(-1: none; the configured gamma, or the auto policy per row)", registry=registry)
        self.request_duration = Histogram("specdec_request_duration_seconds",
                                          "arrival to the end of finished generations",
                                          buckets=self.LATENCY_BUCKETS, registry=registry)
        self._totals = GenerationStats()
        self._lock = threading.Lock()

    def step(self, rows: int, depth: int | None) -> None:
        self.batch_rows.observe(rows)
        self.draft_depth.set(-1 if depth is None else depth)

    def token_latency(self, job: Job, now: float, tokens: int) -> None:
        """A text delta of `tokens` tokens goes out now."""
        if job.last_token is None:
            self.time_to_first_token.observe(now - job.arrived)
        else:
            for _ in range(tokens):
                self.inter_token_latency.observe((now - job.last_token) / max(tokens, 1))
        job.last_token = now

    def record(self, stats: GenerationStats, seconds: float) -> None:
        self.request_duration.observe(seconds)
        with self._lock:
            t = self._totals
            t.generated_tokens += stats.generated_tokens
            t.drafted += stats.drafted
            t.accepted += stats.accepted
            t.target_forwards += stats.target_forwards
            t.total_seconds += stats.total_seconds
            self.generated.inc(stats.generated_tokens)
            self.cached.inc(stats.cached_tokens)
            for source, (tried, accepted) in stats.source_trials.items():
                self.draft_tokens.labels(source).inc(tried)
                self.accepted_draft_tokens.labels(source).inc(accepted)
            self.acceptance.set(t.acceptance_rate or 0.0)
            self.tokens_per_second.set(t.tokens_per_second or 0.0)
            self.tokens_per_forward.set(t.tokens_per_target_forward or 0.0)
