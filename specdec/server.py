"""An OpenAI-compatible HTTP server over one SpeculativeDecoder (`specdec serve`).

Continuous batching: one thread runs every generation in one batch, one engine step at a time
(all rows in one target forward). Requests wait in a bounded first-in first-out queue (429 when it
is full) and join the batch between steps, up to `max_batch` at once; a finished generation leaves
at once, and one whose client went away leaves at the next step, its slots freed. The draft depth
of a step follows the batch size (`specdec.scheduler`). Every error a client can cause is an
OpenAI-style JSON error with a 4xx status.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
import uvicorn

from specdec.api import Generation, SpeculativeDecoder
from specdec.errors import SpecDecError
from specdec.scheduler import BatchDepth, batch_depth
from specdec.types import GenerationStats

MAX_BODY_BYTES = 1 << 20
LONG_PROMPT_CHARS = 20_000  # tokenized in a thread pool, not on the event loop


# ---------------------------------------------------------------------------- request shapes


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What both endpoints accept. Unknown OpenAI fields are ignored; top_k is an extension."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(1.0, ge=0, le=2)
    top_p: float | None = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(0, ge=0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @model_validator(mode="after")
    def _defaults_for_nulls(self):
        """Some clients send an explicit null for "use the default"."""
        for name, default in (("temperature", 1.0), ("top_p", 1.0), ("top_k", 0), ("n", 1), ("stream", False)):
            if getattr(self, name) is None:
                setattr(self, name, default)
        return self


class CompletionRequest(SamplingFields):
    prompt: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


def error_response(message: str, status: int, code: str | None = None, param: str | None = None) -> JSONResponse:
    kind = "rate_limit_error" if status == 429 else "server_error" if status >= 500 else "invalid_request_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


# ---------------------------------------------------------------------------- the batch


@dataclass
class Job:
    """One request: the batch thread fills `events`; the request handler reads them."""

    generation: Generation
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)
    last_token: float | None = None  # when the last text delta went out

    def emit(self, kind: str, value) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class Batcher:
    """Continuous batching on one thread: every running generation advances by one engine step
    at a time, all rows in one target forward. Between steps, waiting jobs join (up to `max_batch`
    run at once) and finished or cancelled ones leave at once. At most `max_queue` jobs wait;
    `submit` refuses beyond that. The draft depth of a step comes from `depth` (a BatchDepth)."""

    def __init__(self, decoder: SpeculativeDecoder, max_batch: int, max_queue: int, metrics: "Metrics", depth: BatchDepth | None):
        self.decoder, self.metrics, self.max_batch, self.max_queue, self.depth = decoder, metrics, max_batch, max_queue, depth
        self.engine = decoder.engine()
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.changed = threading.Condition()
        self.closing: str | None = None  # why new requests are refused (shutting down)
        metrics.queue_depth.set_function(lambda: len(self.waiting))
        metrics.batch_size.set_function(lambda: len(self.running))
        self.thread = threading.Thread(target=self._run, name="specdec-batch", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        with self.changed:
            self.check_room()
            self.waiting.append(job)
            self.changed.notify()

    def check_room(self) -> None:
        """Refuse a request that could not wait now: 429 when the queue is full, 503 when shutting down."""
        if self.closing:
            raise BadRequest(self.closing, status=503)
        if len(self.waiting) >= self.max_queue:
            raise BadRequest(f"the server is busy: {self.max_queue} requests are already waiting", status=429)

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
                self.waiting.popleft().emit("unavailable", "the server is shutting down")
            self.changed.notify()
        self.thread.join(timeout)
        with self.changed:
            self.closing = "the server has shut down"  # the batch thread ends every running job now
            self.changed.notify()
        self.thread.join(5)

    def _run(self) -> None:
        while True:
            with self.changed:
                while not self.waiting and not self.running and not self.closing:
                    self.changed.wait()
                admitted = []
                while self.waiting and len(self.running) + len(admitted) < self.max_batch:
                    admitted.append(self.waiting.popleft())
                stopping = self.closing == "the server has shut down"
            for job in admitted:
                self._open(job)
            for job in [job for job in self.running if job.cancelled.is_set() or stopping]:
                self._retire(job, "unavailable" if stopping else None, "the server shut down before the generation finished")
            if self.running:
                self._step()
            elif self.closing:
                return

    def _open(self, job: Job) -> None:
        try:
            job.generation.open(self.engine)
        except Exception as error:  # never let one request take the batch down
            self.engine.close(job.generation.state)
            job.emit("error", f"{type(error).__name__}: {error}")
            return
        self.running.append(job)
        if job.generation.done:  # nothing to generate (max_tokens 0)
            self._retire(job, "done", None)

    def _step(self) -> None:
        states = [job.generation.state for job in self.running]
        cap = self.depth.depth(len(states)) if self.depth is not None else None
        try:
            results = self.engine.step(states, cap)
        except Exception as error:  # a failed forward leaves the rows' caches unknown: end them all
            for job in list(self.running):
                self._retire(job, "error", f"{type(error).__name__}: {error}")
            return
        now = time.perf_counter()
        for job, result in zip(list(self.running), results):
            if self.depth is not None:
                self.depth.observe(result.drafted, result.accepted)
            delta = job.generation.add(result)
            if delta:
                self.metrics.token_latency(job, now, len(result.tokens))
                job.emit("delta", delta)
            if job.generation.done:
                self._retire(job, "done", None)

    def _retire(self, job: Job, kind: str | None, message: str | None) -> None:
        """The job leaves the batch; its slots go back. kind: what the client is told (None: it left)."""
        self.engine.close(job.generation.state)
        self.running.remove(job)
        if kind is None:
            self.metrics.cancelled.inc()
        elif kind in ("error", "unavailable"):
            job.emit(kind, message)
        else:
            result = job.generation.result()
            self.metrics.record(result.stats, time.perf_counter() - job.arrived)
            job.emit("done", result)


class Metrics:
    """Prometheus counters, gauges and histograms, in a registry of this app's own."""

    LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("specdec_requests", "HTTP requests to the generation endpoints, by status", ["endpoint", "status"], registry=registry)
        self.generated = Counter("specdec_generated_tokens", "tokens generated", registry=registry)
        self.cancelled = Counter("specdec_cancelled", "generations cancelled because the client left", registry=registry)
        self.queue_depth = Gauge("specdec_queue_depth", "requests waiting for the model", registry=registry)
        self.batch_size = Gauge("specdec_batch_size", "generations running in the batch", registry=registry)
        self.acceptance = Gauge("specdec_acceptance_rate", "accepted / drafted over all generations", registry=registry)
        self.tokens_per_second = Gauge("specdec_tokens_per_second", "generated tokens / generation seconds over all generations", registry=registry)
        self.tokens_per_forward = Gauge("specdec_tokens_per_target_forward", "generated tokens / target forwards over all generations", registry=registry)
        self.time_to_first_token = Histogram("specdec_time_to_first_token_seconds", "arrival to the first text delta",
                                             buckets=self.LATENCY_BUCKETS, registry=registry)
        self.inter_token_latency = Histogram("specdec_inter_token_latency_seconds", "time between text deltas of a stream, per token",
                                             buckets=self.LATENCY_BUCKETS, registry=registry)
        self.request_duration = Histogram("specdec_request_duration_seconds", "arrival to the end of finished generations",
                                          buckets=self.LATENCY_BUCKETS, registry=registry)
        self._totals = GenerationStats()
        self._lock = threading.Lock()

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
            self.acceptance.set(t.acceptance_rate or 0.0)
            self.tokens_per_second.set(t.tokens_per_second or 0.0)
            self.tokens_per_forward.set(t.tokens_per_target_forward or 0.0)


# ---------------------------------------------------------------------------- the app


def create_app(decoder: SpeculativeDecoder, model_name: str, max_queue: int = 16, max_batch: int = 16,
               max_body_bytes: int = MAX_BODY_BYTES, depth: BatchDepth | None | str = "measure") -> FastAPI:
    """depth: how deep to draft per batch size; "measure" times the models now (see `batch_depth`)."""
    app = FastAPI(title="specdec", description="OpenAI-compatible lossless speculative decoding", version="1")
    metrics = Metrics()
    batcher = Batcher(decoder, max_batch, max_queue, metrics, batch_depth(decoder) if depth == "measure" else depth)
    app.state.batcher = batcher
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else str(first.get("msg", "invalid request body"))
        return error_response(message, 400, param=where or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        return error_response(str(error.detail), error.status_code)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, error: BadRequest):
        return error_response(str(error), error.status, error.code, error.param)

    @app.middleware("http")
    async def limit_and_count(request: Request, call_next):
        length = request.headers.get("content-length")
        if request.method == "POST" and length is None:  # a chunked body could be any size
            response = error_response("a request body needs a Content-Length header", 411)
        elif length is not None and (not length.isdigit() or int(length) > max_body_bytes):
            response = error_response(f"the request body is larger than {max_body_bytes} bytes", 413)
        else:
            response = await call_next(request)
        if request.url.path in ("/v1/completions", "/v1/chat/completions"):
            metrics.requests.labels(request.url.path, str(response.status_code)).inc()
        return response

    @app.get("/health")
    async def health():
        return {"status": "ok", "queue_depth": len(batcher.waiting), "batch_size": len(batcher.running)}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "specdec"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        generation = await _checked_request(body, len(body.prompt), lambda: decoder.prompt_ids(body.prompt))
        return await _serve(request, body, generation, "text_completion")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        size = sum(len(m.content) for m in body.messages)
        generation = await _checked_request(body, size, lambda: _chat_prompt(decoder, body.messages))
        return await _serve(request, body, generation, "chat.completion")

    async def _checked_request(body: SamplingFields, size: int, encode) -> Generation:
        """Check everything before the request may wait for the model; a full queue is refused
        before the prompt is tokenized. Long texts are tokenized off the event loop; short ones
        inline (a thread hop costs more than they do)."""
        if body.model != model_name:
            raise BadRequest(f"the model {body.model!r} does not exist; this server has {model_name!r}", 404, "model_not_found", "model")
        if body.n != 1:
            raise BadRequest("only n = 1 is supported", param="n")
        stop = body.stops()
        if any(not s for s in stop) or len(stop) > 4:
            raise BadRequest("stop must be up to 4 non-empty strings", param="stop")
        batcher.check_room()
        return await run_in_threadpool(_check, body, encode) if size > LONG_PROMPT_CHARS else _check(body, encode)

    def _check(body: SamplingFields, encode) -> Generation:
        try:
            ids = encode()
        except SpecDecError as error:
            raise BadRequest(str(error), param="prompt") from None
        except Exception as error:  # text the tokenizer cannot take, e.g. a lone surrogate
            raise BadRequest(f"the prompt cannot be tokenized: {type(error).__name__}", param="prompt") from None
        room = decoder.target.max_length - len(ids)
        if body.max_tokens is None:
            body.max_tokens = min(16, room) if isinstance(body, CompletionRequest) else room
        if body.max_tokens > room:
            raise BadRequest(f"max_tokens {body.max_tokens} plus the prompt's {len(ids)} tokens exceed the context of {decoder.target.max_length}",
                             param="max_tokens")
        try:
            return decoder.request(ids, max_new_tokens=body.max_tokens, temperature=body.temperature, top_k=body.top_k,
                                   top_p=body.top_p, seed=body.seed, stop=body.stops())
        except SpecDecError as error:
            raise BadRequest(str(error)) from None

    async def _serve(request: Request, body: SamplingFields, generation: Generation, kind: str):
        job = Job(generation, asyncio.get_running_loop())
        batcher.submit(job)
        reply = Reply(kind, model_name, len(generation.state.prompt))
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return CancellingStream(lambda: batcher.cancel(job), _sse(job, reply, include_usage), media_type="text/event-stream")
        try:
            result = await _result(request, job)
        finally:  # whatever ends this handler, the batch stops working for it
            batcher.cancel(job)
        if result is None:
            return error_response("the client disconnected", 499)
        if isinstance(result, tuple):
            kind, message = result
            return error_response(message, 503) if kind == "unavailable" else error_response(f"generation failed: {message}", 500)
        return reply.whole(result)

    async def _result(request: Request, job: Job):
        """The finished GenerationResult; None if the client left; (kind, message) if it failed."""
        while True:
            try:
                kind, value = await asyncio.wait_for(job.events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return None
                continue
            if kind == "done":
                return value
            if kind != "delta":
                return kind, value

    async def _sse(job: Job, reply: "Reply", include_usage: bool):
        try:
            first = reply.chunk("", None, first=True)
            if first is not None:
                yield _event(first)
            while True:
                kind, value = await job.events.get()
                if kind == "delta":
                    yield _event(reply.chunk(value, None))
                elif kind in ("error", "unavailable"):
                    message = value if kind == "unavailable" else f"generation failed: {value}"
                    yield _event({"error": {"message": message, "type": "server_error", "param": None, "code": kind}})
                    break
                else:
                    yield _event(reply.chunk("", value.finish_reason))
                    if include_usage:
                        yield _event(reply.usage_chunk(value))
                    break
            yield "data: [DONE]\n\n"
        finally:  # a client that left (the response is cancelled) stops its generation
            batcher.cancel(job)

    return app


class Server(uvicorn.Server):
    """uvicorn, shutting down in bounded time: on SIGTERM/SIGINT the batch refuses new requests
    (503), ends waiting ones with an error event and gives running ones `shutdown_timeout` seconds
    before they end with an error event too (streams still get their `[DONE]`)."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout: float):
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout

    def handle_exit(self, sig, frame) -> None:
        batcher = self.config.app.state.batcher
        threading.Thread(target=batcher.shut_down, args=(self.shutdown_timeout,), daemon=True).start()
        super().handle_exit(sig, frame)


def serve(app: FastAPI, host: str, port: int, shutdown_timeout: float = 10.0) -> None:
    config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=int(shutdown_timeout) + 3)  # a backstop: the batch ends its streams first
    Server(config, shutdown_timeout).run()


class CancellingStream(StreamingResponse):
    """A streaming response that runs `on_exit` however it ends, even when the client leaves
    before the first chunk (then the body generator never starts, so its own finally cannot)."""

    def __init__(self, on_exit, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.on_exit = on_exit

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_exit()


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _chat_prompt(decoder: SpeculativeDecoder, messages: list[ChatMessage]) -> list[int]:
    tokenizer = decoder.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise SpecDecError("this model's tokenizer has no chat template; use /v1/completions")
    try:
        ids = tokenizer.apply_chat_template([m.model_dump() for m in messages], add_generation_prompt=True, tokenize=True)
    except Exception as error:  # a template may reject a conversation (e.g. roles out of order)
        raise SpecDecError(f"the chat template rejected these messages: {error}") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return decoder.prompt_ids(list(ids))


class Reply:
    """OpenAI response objects for one request: whole, or as stream chunks."""

    def __init__(self, kind: str, model: str, prompt_tokens: int):
        self.kind, self.model, self.prompt_tokens = kind, model, prompt_tokens
        self.id = ("chatcmpl-" if kind.startswith("chat") else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    @property
    def chat(self) -> bool:
        return self.kind.startswith("chat")

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, result) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text}, "finish_reason": result.finish_reason}
        else:
            choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": result.finish_reason}
        return {**self._head(self.kind), "choices": [choice], "usage": self._usage(result), "speculative": _speculative(result.stats)}

    def chunk(self, text: str, finish_reason: str | None, first: bool = False) -> dict | None:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        if first:
            return None
        return {**self._head("text_completion"), "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}

    def usage_chunk(self, result) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [], "usage": self._usage(result), "speculative": _speculative(result.stats)}

    def _usage(self, result) -> dict:
        completion = len(result.tokens)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion, "total_tokens": self.prompt_tokens + completion}


def _speculative(stats: GenerationStats) -> dict:
    """The extension field: how the speculation went for this request."""
    return {
        "acceptance_rate": stats.acceptance_rate,
        "tokens_per_target_forward": stats.tokens_per_target_forward,
        "target_forwards": stats.target_forwards,
        "draft_forwards": stats.draft_forwards,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
    }
