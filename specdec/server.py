"""An OpenAI-compatible HTTP server over one SpeculativeDecoder (`specdec serve`).

One loaded model pair, so one generation at a time: requests wait in a bounded first-in first-out
queue (429 when it is full) and a single worker thread runs them off the event loop. A request
whose client went away is cancelled between two decoding steps and its slot freed. Every error a
client can cause is an OpenAI-style JSON error with a 4xx status.
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
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.api import SpeculativeDecoder
from specdec.errors import SpecDecError
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


# ---------------------------------------------------------------------------- the queue


@dataclass
class Job:
    """One generation: the worker thread fills `events`; the request handler reads them."""

    prompt_ids: list[int]
    options: dict
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, kind: str, value) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class Worker:
    """A single thread that runs jobs in arrival order. At most `max_queue` jobs wait (one more
    may be running); `submit` refuses beyond that, and `cancel` takes a waiting job out at once."""

    def __init__(self, decoder: SpeculativeDecoder, max_queue: int, metrics: "Metrics"):
        self.decoder, self.metrics, self.max_queue = decoder, metrics, max_queue
        self.waiting: deque[Job] = deque()
        self.changed = threading.Condition()
        metrics.queue_depth.set_function(lambda: len(self.waiting))
        threading.Thread(target=self._run, name="specdec-worker", daemon=True).start()

    def submit(self, job: Job) -> None:
        with self.changed:
            if len(self.waiting) >= self.max_queue:
                raise BadRequest(f"the server is busy: {self.max_queue} requests are already waiting", status=429)
            self.waiting.append(job)
            self.changed.notify()

    def cancel(self, job: Job) -> None:
        """The client left: a waiting job leaves the queue now, a running one stops at its next step."""
        if job.cancelled.is_set():
            return
        job.cancelled.set()
        with self.changed:
            if job in self.waiting:
                self.waiting.remove(job)
                self.metrics.cancelled.inc()

    def _run(self) -> None:
        while True:
            with self.changed:
                while not self.waiting:
                    self.changed.wait()
                job = self.waiting.popleft()
            try:
                self._generate(job)
            except Exception as error:  # never let one request take the worker down
                job.emit("error", f"{type(error).__name__}: {error}")

    def _generate(self, job: Job) -> None:
        stream = self.decoder.stream(job.prompt_ids, **job.options)
        deltas = iter(stream)
        try:
            for delta in deltas:
                if job.cancelled.is_set():
                    self.metrics.cancelled.inc()
                    return
                job.emit("delta", delta)
        finally:
            deltas.close()  # frees the decoder for the next job, cancelled or not
        self.metrics.record(stream.result.stats)
        job.emit("done", stream.result)


class Metrics:
    """Prometheus counters and gauges, in a registry of this app's own."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("specdec_requests", "HTTP requests to the generation endpoints, by status", ["endpoint", "status"], registry=self.registry)
        self.generated = Counter("specdec_generated_tokens", "tokens generated", registry=self.registry)
        self.cancelled = Counter("specdec_cancelled", "generations cancelled because the client left", registry=self.registry)
        self.queue_depth = Gauge("specdec_queue_depth", "requests waiting for the model", registry=self.registry)
        self.acceptance = Gauge("specdec_acceptance_rate", "accepted / drafted over all generations", registry=self.registry)
        self.tokens_per_second = Gauge("specdec_tokens_per_second", "generated tokens / generation seconds over all generations", registry=self.registry)
        self.tokens_per_forward = Gauge("specdec_tokens_per_target_forward", "generated tokens / target forwards over all generations", registry=self.registry)
        self._totals = GenerationStats()
        self._lock = threading.Lock()

    def record(self, stats: GenerationStats) -> None:
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


def create_app(decoder: SpeculativeDecoder, model_name: str, max_queue: int = 16, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="specdec", description="OpenAI-compatible lossless speculative decoding", version="1")
    metrics = Metrics()
    worker = Worker(decoder, max_queue, metrics)
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
        return {"status": "ok", "queue_depth": len(worker.waiting)}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "specdec"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        ids = await _checked_prompt(body, len(body.prompt), lambda: decoder.prompt_ids(body.prompt))
        return await _serve(request, body, ids, "text_completion")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        size = sum(len(m.content) for m in body.messages)
        ids = await _checked_prompt(body, size, lambda: _chat_prompt(decoder, body.messages))
        return await _serve(request, body, ids, "chat.completion")

    async def _checked_prompt(body: SamplingFields, size: int, encode) -> list[int]:
        """Tokenize and check everything before the request may wait for the model. Long texts are
        tokenized off the event loop; short ones inline (a thread hop costs more than they do)."""
        return await run_in_threadpool(_check, body, encode) if size > LONG_PROMPT_CHARS else _check(body, encode)

    def _check(body: SamplingFields, encode) -> list[int]:
        if body.model != model_name:
            raise BadRequest(f"the model {body.model!r} does not exist; this server has {model_name!r}", 404, "model_not_found", "model")
        if body.n != 1:
            raise BadRequest("only n = 1 is supported", param="n")
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
        stop = body.stops()
        if any(not s for s in stop) or len(stop) > 4:
            raise BadRequest("stop must be up to 4 non-empty strings", param="stop")
        return ids

    async def _serve(request: Request, body: SamplingFields, ids: list[int], kind: str):
        options = dict(max_new_tokens=body.max_tokens, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                       seed=body.seed, stop=body.stops())
        job = Job(ids, options, asyncio.get_running_loop())
        worker.submit(job)
        reply = Reply(kind, model_name, len(ids))
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return CancellingStream(lambda: worker.cancel(job), _sse(job, reply, include_usage), media_type="text/event-stream")
        try:
            result = await _result(request, job)
        finally:  # whatever ends this handler, the worker stops working for it
            worker.cancel(job)
        if result is None:
            return error_response("the client disconnected", 499)
        if isinstance(result, str):
            return error_response(f"generation failed: {result}", 500)
        return reply.whole(result)

    async def _result(request: Request, job: Job):
        """The finished GenerationResult; None if the client left; the message if generation failed."""
        while True:
            try:
                kind, value = await asyncio.wait_for(job.events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return None
                continue
            if kind != "delta":
                return value

    async def _sse(job: Job, reply: "Reply", include_usage: bool):
        try:
            first = reply.chunk("", None, first=True)
            if first is not None:
                yield _event(first)
            while True:
                kind, value = await job.events.get()
                if kind == "delta":
                    yield _event(reply.chunk(value, None))
                elif kind == "error":
                    yield _event({"error": {"message": f"generation failed: {value}", "type": "server_error", "param": None, "code": None}})
                    break
                else:
                    yield _event(reply.chunk("", value.finish_reason))
                    if include_usage:
                        yield _event(reply.usage_chunk(value))
                    break
            yield "data: [DONE]\n\n"
        finally:  # a client that left (the response is cancelled) stops its generation
            worker.cancel(job)

    return app


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
