"""The FastAPI app over a Service: routes, checks before a request may wait, and streaming."""

from __future__ import annotations

import asyncio
import hmac
import json
import re
from typing import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.api import Generation, GenerationResult, SpeculativeDecoder
from specdec.policy import BatchDepth
from specdec.server.batch import Delta, Done, Failed, Job, QueueFull, Refused, ShuttingDown, Unavailable
from specdec.server.lanes import FairLanes
from specdec.server.openai import (ERROR_RESPONSES, BadRequest, ChatRequest, CompletionRequest, ErrorBody, Reply,
                                   SamplingFields, chat_prompt, error_response)
from specdec.server.service import Health, Service
from specdec.tools import ToolUse

MAX_BODY_BYTES = 1 << 20
LONG_PROMPT_CHARS = 20_000  # tokenized off the event loop, in its API key's lane (`FairLanes`)
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
# where `Admission` leaves an accepted request's API key: for its scope (the key's index; None: no
# scope of its own), and for its turns (the index, or None without keys: one lane for all)
KEY_STATE, CLIENT_STATE = "specdec_api_key", "specdec_client"
# host[:port], nothing else
HOST_HEADER = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9.-]+))(?::[0-9]{1,5})?")
STREAM_OR_JSON = {200: {"description": "The whole reply as JSON, or with `stream: true` server-sent events: "
                                       "one `data: {chunk}` per text delta (an error event if the generation fails), "
                                       "then `data: [DONE]`",
                        "content": {"text/event-stream": {"schema": {"type": "string"}}}}}
REFUSED_STATUS = {QueueFull: 429, ShuttingDown: 503}  # the batch's refusals, as HTTP (both with Retry-After)
METRICS_RESPONSES = {401: {"model": ErrorBody, "description": "The operator's key (--metrics-key) is missing"},
                     403: {"model": ErrorBody, "description": "A tenant's API key: server-wide counters are the "
                                                              "operator's"}}
HEALTH_RESPONSES = {503: {"description": "The server is shutting down, or its batch is not making progress: "
                                         "send no more requests here"}}


def create_app(decoder: SpeculativeDecoder, model_name: str, max_queue: int = 16, max_batch: int = 16,
               depth: BatchDepth | None | str = "measure", **http) -> FastAPI:
    """The routes over a new Service (see it for the arguments); `http`: see `routes`."""
    return routes(Service(decoder, model_name, max_queue, max_batch, depth), **http)


def routes(service: Service, max_body_bytes: int = MAX_BODY_BYTES, api_keys: Sequence[str] = (),
           allowed_origins: Sequence[str] = (), allowed_hosts: Sequence[str] | None = None, body_timeout: float = 30.0,
           keys_share_caches: bool = False, metrics_key: str | None = None,
           public_metrics: bool = False) -> FastAPI:
    """The OpenAI routes, /health and /metrics over a service.

    api_keys: /v1 routes need `Authorization: Bearer <key>` with one of them; each key is a tenant,
    with a scope of its own for kept caches, histories and learnt acceptance (`specdec.scopes`),
    unless `keys_share_caches`. No keys: one tenant. /metrics counts every tenant's requests, so it
    answers only `metrics_key` (the operator's), or anyone with `public_metrics`, or anyone on a
    server of one tenant (no keys of either kind); a tenant's key gets 403 there.
    allowed_origins: browser origins allowed by CORS. allowed_hosts: accepted Host header names
    (None: any). body_timeout: seconds a request body may take to arrive."""
    app = FastAPI(title="specdec", description="OpenAI-compatible lossless speculative decoding", version="1")
    app.state.service = service
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_exception_handler(RequestValidationError, invalid_body)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(BadRequest, bad_request)
    app.add_exception_handler(Refused, refused)
    endpoints = Endpoints(service)
    app.add_api_route("/health", endpoints.health, methods=["GET"], responses=HEALTH_RESPONSES)
    app.add_api_route("/health", endpoints.health, methods=["HEAD"], include_in_schema=False)
    app.add_api_route("/metrics", endpoints.prometheus, methods=["GET"], response_class=PlainTextResponse,
                      responses=METRICS_RESPONSES)
    app.add_api_route("/v1/models", endpoints.models, methods=["GET"], responses={401: ERROR_RESPONSES[401]})
    app.add_api_route("/v1/completions", endpoints.completions, methods=["POST"],
                      responses={**STREAM_OR_JSON, **ERROR_RESPONSES})
    app.add_api_route("/v1/chat/completions", endpoints.chat, methods=["POST"],
                      responses={**STREAM_OR_JSON, **ERROR_RESPONSES})
    app.openapi = lambda: schema_without_422(app)
    app.add_middleware(BodyDeadline, timeout=body_timeout)
    # outermost: it counts what the client is sent, a BodyDeadline 408 included
    admission = Admission(max_body_bytes, api_keys, allowed_hosts, keys_share_caches, metrics_key, public_metrics)
    app.add_middleware(Guard, refusal=admission.refusal,
                       count=lambda path, status: service.metrics.requests.labels(path, str(status)).inc())
    return app


# ---------------------------------------------------------------------------- errors


async def invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
    """A body the wire format refuses: a 400 naming its first wrong field (FastAPI would send a 422)."""
    first = error.errors()[0] if error.errors() else {}
    if first.get("type") == "json_invalid":  # its loc holds a character offset, not a field
        reason = first.get("ctx", {}).get("error", "JSON decode error")
        return error_response(f"the request body is not valid JSON: {reason} (at character {first['loc'][-1]})", 400)
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    message = (f"{where}: {first.get('msg', 'invalid request')}" if where
               else str(first.get("msg", "invalid request body")))
    return error_response(message, 400, param=where or None)


async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    # 405 keeps Allow
    return error_response(str(error.detail), error.status_code, headers=getattr(error, "headers", None))


async def bad_request(request: Request, error: BadRequest) -> JSONResponse:
    return error_response(str(error), error.status, error.code, error.param)


async def refused(request: Request, error: Refused) -> JSONResponse:
    return error_response(str(error), REFUSED_STATUS[type(error)])


def schema_without_422(app: FastAPI) -> dict:
    """The app's schema without FastAPI's 422 (validation errors are answered with 400, documented per route)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for path in schema["paths"].values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


# ---------------------------------------------------------------------------- before routing


class Admission:
    """What a request must pass before any route sees it: an allowed Host header, the right key on
    the guarded paths (a tenant's on /v1, the operator's on /metrics), and a Content-Length within
    `max_body_bytes` (see `routes` for the rest)."""

    def __init__(self, max_body_bytes: int, api_keys: Sequence[str], allowed_hosts: Sequence[str] | None,
                 keys_share_caches: bool, metrics_key: str | None = None, public_metrics: bool = False):
        self.max_body_bytes, self.allowed_hosts = max_body_bytes, allowed_hosts
        self.keys_share_caches = keys_share_caches
        self.expected = [bearer(key) for key in api_keys]
        self.metrics_key = bearer(metrics_key) if metrics_key is not None else None
        # one tenant (no keys of either kind) has no one to hide its counters from
        self.open_metrics = public_metrics or (not api_keys and metrics_key is None)

    def key_index(self, given: str) -> int | None:
        """Which key the Authorization header holds (compared with every key, in constant time each)."""
        matches = [i for i, key in enumerate(self.expected) if hmac.compare_digest(given.encode(), key)]
        return matches[0] if matches else None

    def refusal(self, request: Request) -> JSONResponse | None:
        """An error response for a request refused before routing, or None. An accepted request's
        API key (its index) is left in its scope's state for the routes."""
        if self.allowed_hosts is not None and not host_allowed(request, self.allowed_hosts):
            return error_response(f"the Host header {request.headers.get('host')!r} is not one this server answers to",
                                  400)
        path, given = request.url.path, request.headers.get("authorization", "")
        if path == "/metrics" and not self.open_metrics:
            refused = self.metrics_refusal(given)
            if refused is not None:
                return refused
        if self.expected and path.startswith("/v1/") and request.method != "OPTIONS":
            key = self.key_index(given)
            if key is None:
                return no_key("a valid API key is needed: Authorization: Bearer <key>")
            state = request.scope.setdefault("state", {})
            state[KEY_STATE], state[CLIENT_STATE] = None if self.keys_share_caches else key, key
        length = request.headers.get("content-length")
        if request.method == "POST" and length is None:  # a chunked body could be any size
            return error_response("a request body needs a Content-Length header", 411)
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return error_response(f"the request body is larger than {self.max_body_bytes} bytes", 413)
        return None

    def metrics_refusal(self, given: str) -> JSONResponse | None:
        """/metrics' counters are server-wide: only the operator's key opens them, never a tenant's."""
        if self.metrics_key is not None and hmac.compare_digest(given.encode(), self.metrics_key):
            return None
        why = ("/metrics counts every tenant's requests: it needs the operator's key (--metrics-key)"
               if self.metrics_key is not None else
               "/metrics counts every tenant's requests: the server was started without --metrics-key "
               "or --public-metrics")
        if self.key_index(given) is not None:
            return error_response(why, 403, "forbidden")
        return no_key(why)


def bearer(key: str) -> bytes:
    return f"Bearer {key}".encode()


def no_key(message: str) -> JSONResponse:
    return error_response(message, 401, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


# ---------------------------------------------------------------------------- endpoints


class Endpoints:
    """One method per route, over one service. The generation endpoints share the way in
    (`_checked_request`) and the way out (`_serve`)."""

    def __init__(self, service: Service):
        self.service = service
        self.long_texts = FairLanes(limit=service.max_queue)  # each key's in turn, a few threads at most

    async def health(self) -> JSONResponse:
        health = self.service.health()
        return JSONResponse(health_body(health), status_code=200 if health.ok else 503)

    async def prometheus(self) -> PlainTextResponse:
        return PlainTextResponse(generate_latest(self.service.metrics.registry).decode(),
                                 media_type="text/plain; version=0.0.4")

    async def models(self):  # no return annotation: FastAPI would make it the response's model
        service = self.service
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": service.created,
                                            "owned_by": "specdec"}]}

    async def completions(self, body: CompletionRequest, request: Request):
        decoder = self.service.decoder
        prompt = body.prompt_input()
        size = len(prompt) if isinstance(prompt, str) else 0
        generations = await self._checked_request(request, body, size, lambda: decoder.prompt_ids(prompt), "prompt")
        echo = ("" if not body.echo else prompt if isinstance(prompt, str)
                else decoder.tokenizer.decode(prompt, skip_special_tokens=True))
        return await self._serve(request, body, generations, self._reply("text_completion", generations[0], echo))

    async def chat(self, body: ChatRequest, request: Request):
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        body.use_tools(self.service.decoder.tool_format)
        size = sum(len(m.for_template()["content"]) for m in body.messages)
        size += sum(len(tool.model_dump_json()) for tool in body.tools or [])
        generations = await self._checked_request(request, body, size,
                                                  lambda: chat_prompt(self.service.decoder, body), "messages")
        return await self._serve(request, body, generations,
                                 self._reply("chat.completion", generations[0], tools=body.tool_use()))

    def _reply(self, kind: str, generation: Generation, echo: str = "", tools: ToolUse | None = None) -> Reply:
        return Reply(kind, self.service.model_name, len(generation.state.prompt), self.service.decoder.tokenizer, echo,
                     tools)

    async def _checked_request(self, request: Request, body: SamplingFields, size: int, encode,
                               param: str) -> list[Generation]:
        """Check everything before the request may wait for the model; a full queue is refused
        before the prompt is tokenized. Long texts (a prompt, a prediction) are tokenized off the
        event loop, each API key's in turn (`FairLanes`); short ones inline (a thread hop costs more
        than they do). A structured output's grammar is compiled off the loop too (the model's grammar
        tokenizer is built on the first: seconds on a large vocabulary)."""
        service = self.service
        if body.model != service.model_name:
            raise BadRequest(f"the model {body.model!r} does not exist; this server has {service.model_name!r}", 404,
                             "model_not_found", "model")
        body.refuse_unsupported()
        service.check_room()
        state = request.scope.get("state", {})
        check = lambda: service.generations(body, encode, param, state.get(KEY_STATE))
        size += len(body.predicted_text() or "")
        off_the_loop = size > LONG_PROMPT_CHARS or body.constraint() is not None
        return await self.long_texts.run(state.get(CLIENT_STATE), check) if off_the_loop else check()

    async def _serve(self, request: Request, body: SamplingFields, generations: list[Generation], reply: Reply):
        """The reply to the request's generations (its choices, rows of the batch): a stream of events, or
        the whole reply once every one has finished."""
        service, jobs = self.service, []
        cancel = lambda: [service.cancel(job) for job in jobs]
        try:
            for generation in generations:
                jobs.append(service.submit(generation))
        except BaseException:  # the queue filled part way: none of the request's choices runs
            cancel()
            raise
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = _sse(service, jobs, reply, include_usage)
            return CancellingStream(cancel, events, media_type="text/event-stream")
        try:
            endings = [await _ending(request, job) for job in jobs]  # they run together; collected in order
        finally:  # whatever ends this handler, the batch stops working for it
            cancel()
        return await _whole(endings, reply)


# ---------------------------------------------------------------------------- replies


async def _whole(endings: list[Done | Failed | Unavailable | None], reply: Reply):
    """The response to a non-streamed request, from what `_ending` gave for each of its choices."""
    for ending in endings:
        match ending:
            case None:
                return error_response("the client disconnected", 499)
            case Unavailable(message):
                return error_response(message, 503)
            case Failed(message):
                return error_response(f"generation failed: {message}", 500)
    results = [ending.result for ending in endings]
    try:
        # a decode per token and alternative, an alignment: not on the event loop
        if any(result.logprobs or result.prediction for result in results):
            return await run_in_threadpool(reply.whole, results)
        return reply.whole(results)
    except Exception as error:  # the reply could not be made: still an answer in the API's shape
        return error_response(f"generation failed: the reply could not be made: {type(error).__name__}", 500)


async def _ending(request: Request, job: Job) -> Done | Failed | Unavailable | None:
    """The job's last event (Deltas are passed over); None as soon as the client leaves."""
    left, event = asyncio.ensure_future(_disconnect(request)), None
    try:
        while True:
            event = asyncio.ensure_future(job.events.get())
            await asyncio.wait((event, left), return_when=asyncio.FIRST_COMPLETED)
            if not event.done():
                return None
            if not isinstance(ending := event.result(), Delta):
                return ending
    finally:  # however this ends (the handler itself may be cancelled), no task is left waiting
        left.cancel()
        if event is not None:
            event.cancel()


async def _sse(service: Service, jobs: list[Job], reply: Reply, include_usage: bool):
    """The events of a stream, its choices' interleaved as they come; however a generation or the making
    of an event fails, that choice's events end with an error event, and the stream with `[DONE]`."""
    try:
        for index in range(len(jobs)):
            first = reply.chunk("", None, first=True, index=index)
            if first is not None:
                yield _event(first)
        results: list[GenerationResult | None] = [None] * len(jobs)
        async for event in _merged([_events(service, job, reply, index, results) for index, job in enumerate(jobs)]):
            yield event
        if include_usage and all(result is not None for result in results):
            try:
                yield _event(await run_in_threadpool(reply.usage_chunk, results))
            except Exception as error:  # the client is told, in the stream's shape
                yield error_event(f"generation failed: the reply could not be made: {type(error).__name__}", "error")
        yield "data: [DONE]\n\n"
    finally:  # a client that left (the response is cancelled) stops its generations
        for job in jobs:
            service.cancel(job)


async def _merged(streams: list):
    """The items of several async streams, as each comes (one stream: itself, no task)."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream) -> None:
        try:
            async for item in stream:
                await queue.put(item)
        finally:
            await queue.put(None)  # this stream is done

    tasks = [asyncio.ensure_future(pump(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


async def _events(service: Service, job: Job, reply: Reply, index: int, results: list):
    """Choice `index`'s events: one per Delta, then its last chunk (its result into `results`), or an
    error event; then it returns."""
    while True:
        event = await job.events.get()
        try:
            match event:
                case Delta(text, logprobs):
                    yield _event(reply.chunk(text, None, logprobs, index=index))
                    continue
                case Unavailable(message):
                    yield error_event(message, "unavailable")
                case Failed(message):
                    yield error_event(f"generation failed: {message}", "error")
                case Done(result):
                    rest = result.logprobs[job.logprobs_sent:] if result.logprobs is not None else None
                    yield _event(reply.chunk("", result.finish_reason, rest, index=index))
                    results[index] = result
            return
        except Exception as error:  # an event could not be made: the client is told, the generation stops
            service.cancel(job)
            yield error_event(f"generation failed: the reply could not be made: {type(error).__name__}", "error")
            return


async def _disconnect(request: Request) -> None:
    """Returns when the client has gone. Once the body is read, the server's next message is the
    disconnect: waiting for it costs nothing (`Request.is_disconnected` only peeks, and behind
    Starlette's BaseHTTPMiddleware a peek never sees it, see `Guard`)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Guard:
    """ASGI middleware: refuses what must not reach a route (wrong Host, no API key, no or too big a
    Content-Length) and counts the generation endpoints' replies by status.

    Pure ASGI on purpose: Starlette's BaseHTTPMiddleware (`@app.middleware("http")`) hands the
    route a receive that goes through an anyio task group, whose set-up is a cancellation point,
    so `Request.is_disconnected()` (a receive inside an already cancelled scope) was cancelled
    there every time, before the server's receive could report the disconnect: non-streamed
    requests never noticed their client leave."""

    def __init__(self, app, refusal, count):
        self.app, self.refusal, self.count = app, refusal, count

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        counted = scope["path"] in GENERATION_PATHS

        async def counting_send(message):
            if counted and message["type"] == "http.response.start":
                self.count(scope["path"], message["status"])
            await send(message)

        refused = self.refusal(Request(scope))
        if refused is not None:
            return await refused(scope, receive, counting_send)
        await self.app(scope, receive, counting_send)


class BodyDeadline:
    """ASGI middleware: a request body must arrive within `timeout` seconds of the request head (a
    slow client cannot hold a connection by trickling its body). When it does not, the app is told
    the client left and the client gets a 408 instead of whatever the app would have answered."""

    def __init__(self, app, timeout: float):
        self.app, self.timeout = app, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        body_done = timed_out = started = False

        async def timed_receive():
            nonlocal body_done, timed_out
            if body_done:  # afterwards a streaming response waits here for the client to leave
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                timed_out = body_done = True
                return {"type": "http.disconnect"}
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def guarded_send(message):
            nonlocal started
            if not timed_out:
                started = True
                await send(message)

        await self.app(scope, timed_receive, guarded_send)
        # the rest of the body may still come: the connection cannot serve another request
        if timed_out and not started:
            await error_response(f"the request body did not arrive within {self.timeout:g} seconds", 408,
                                 headers={"Connection": "close"})(scope, receive, send)


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


def health_body(health: Health) -> dict:
    """/health's JSON: the status, how long the batch has stalled (only when unhealthy), its work."""
    stalled = {} if health.stalled_seconds is None else {"stalled_seconds": health.stalled_seconds}
    return {"status": health.status, **stalled, "queue_depth": health.queue_depth, "batch_size": health.batch_size}


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def error_event(message: str, code: str) -> str:
    """A stream's error event, as the API's errors read."""
    return _event({"error": {"message": message, "type": "server_error", "param": None, "code": code}})


def host_name(header: str) -> str | None:
    """The host a Host header names ("name", "name:port", "[v6]:port"), in lower case; None when
    the header is not of that form (empty, or with userinfo, a path, a query or a fragment)."""
    match = HOST_HEADER.fullmatch(header)
    return None if match is None else (match["v6"] or match["name"]).lower()


def host_allowed(request: Request, allowed: Sequence[str]) -> bool:
    """The Host header names an allowed host. An HTTP/1.0 request may come without one (it then
    means this server's own address; a browser always sends one)."""
    header = request.headers.get("host")
    if header is None:
        return request.scope.get("http_version") == "1.0"
    return host_name(header) in allowed
