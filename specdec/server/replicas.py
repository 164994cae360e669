"""`specdec serve` as a Ray Serve application: replicas of the service behind an ingress that keeps
a conversation where its cache is.

    HTTP -> Ray's proxy -> Ingress (reads the body, names the request's conversation)
         -> ConversationRouter (`routing`: the replica that served the conversation, while it accepts work;
            else power of two choices) -> Replica (a Service and its routes, as under uvicorn)

A replica runs the very routes of `specdec serve` (`routes(Service)`): the ingress hands it the
HTTP request (method, path, headers, body) and relays the ASGI messages it answers, so errors,
authentication, limits and streaming are the single-process server's. Ray sends a replica at most
`max_ongoing_requests` = its batch at once: the rest wait in Ray's queue, not a replica's.

Faults: a request whose replica dies before the client got a byte of its reply is sent to another
(up to RESUBMITS times; its generation starts again there): a non-streamed reply is one message, so
it always is; a stream cut later ends with an SSE error event and `[DONE]`. Ray's health checks
call the service's liveness (`Service.health`).

Shutting down (`specdec serve --replicas`, on SIGTERM or Ctrl-C): the ingress drains first
(`Ingress.drain`): new requests get 503, those in flight have `--shutdown-timeout` seconds to
finish, then a stream still running ends with an error event and `[DONE]`, a reply not begun with
a 503; only then does Ray stop. The ingress answers everything, `/health` included, with 503 until
the command's own signal handlers are in place (`Ingress.open`, see `run_local`): from the first
200 on, a SIGTERM drains; before it, it stops what was starting and exits cleanly. Under
`serve run`/`serve deploy`, Ray's own graceful shutdown waits up to `--shutdown-timeout` for
requests in flight (`graceful_shutdown_timeout_s`) and then stops the replicas, cutting what still
runs.

Started with `serve run specdec.server.replicas:build target=... replicas=2 threads=1` (an app
builder: the arguments are `specdec serve`'s long options), a Serve config file (deploy/serve.yaml),
or `specdec serve --replicas N` (a local Ray instance).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
from dataclasses import replace

from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError

from specdec.build import build_decoder
from specdec.config import ServeConfig, serve_config, with_runtime
from specdec.server.app import MAX_BODY_BYTES, error_event
from specdec.server.build import build_app, build_service, max_batch
from specdec.server.openai import error_response
from specdec.server.routing import Affinity, ConversationRouter, Forwarded, affinity

RESUBMITS = 2  # further replicas a request whose replica died before answering is tried on
BODY_TIMEOUT = 30.0  # seconds a request body may take to arrive (as `specdec serve`'s)
REPLICA_HEADER = b"x-specdec-replica"  # which replica answered
RESUBMITS_HEADER = b"x-specdec-resubmits"  # how many replicas died under the request before it was answered


# ---------------------------------------------------------------------------- the deployments
class Replica:
    """One replica: `specdec serve`'s service and routes, on cores of its own."""

    def __init__(self, config: ServeConfig):
        self.shutdown_timeout = config.shutdown_timeout
        pin_cores(config.decoder.runtime.threads, replica_rank())
        self.service = build_service(config)  # reads the profile measured before replicas started
        self.app = build_app(config, self.service)
        self.name = replica_name().encode()

    async def forward(self, request: Forwarded, affinity: Affinity | None = None):
        """The routes' ASGI messages for one request (http.response.start, then the body's);
        `affinity` is for the router, which reads it from the call. If
        this is cancelled (the client left, the ingress gave up) the route is cancelled with it,
        and the batch drops its generation."""
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": request.http_version,
                 "method": request.method, "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
                 "query_string": request.query_string, "root_path": "", "headers": request.headers,
                 "client": request.client, "server": None}
        messages: asyncio.Queue = asyncio.Queue()
        delivered = False

        async def receive():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await asyncio.Event().wait()  # the client is there until this request is cancelled

        async def send(message):
            await messages.put(message)

        async def run():
            try:
                await self.app(scope, receive, send)
            finally:
                await messages.put(None)

        task = asyncio.ensure_future(run())
        try:
            while (message := await messages.get()) is not None:
                # which replica answered: for logs, and to see the routing work
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER, self.name)]}
                yield message
        finally:
            task.cancel()

    def check_health(self) -> None:
        """Ray's health check: the batch's liveness. Raising marks the replica unhealthy; Ray replaces it."""
        health = self.service.health()
        if health.unhealthy:
            raise RuntimeError(health.status)

    async def __del__(self):
        """Ray's graceful shutdown: refuse new work, let running generations finish."""
        await asyncio.get_running_loop().run_in_executor(None, self.service.drain, self.shutdown_timeout)


class Ingress:
    """Reads each request's body (within `body_timeout` seconds, at most `max_body_bytes`), names its
    conversation and hands the request to a replica (ConversationRouter picks which); relays the
    reply. Resubmits to another replica when one dies before the client saw any of its reply.
    `drain` shuts it down gracefully."""

    def __init__(self, replicas, max_body_bytes: int = MAX_BODY_BYTES, body_timeout: float = BODY_TIMEOUT,
                 opened: bool = True):
        # one streaming handle for every request: each handle has a router of its own, with its own memory
        self.replicas = replicas.options(stream=True)
        self.max_body_bytes, self.body_timeout = max_body_bytes, body_timeout
        self.opened = opened  # until then every request gets 503: who started it cannot drain it yet
        self.draining = False  # new requests get 503
        self.out_of_time = asyncio.Event()  # the drain's time is up: requests in flight are ended
        self.in_flight = 0

    async def drain(self, timeout: float) -> int:
        """Refuse new requests (503, /health too), give those in flight `timeout` seconds to finish,
        then end them (see `_unless_stopped`). Returns how many had to be ended."""
        self.draining = True
        deadline = asyncio.get_running_loop().time() + timeout
        while self.in_flight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        ended = self.in_flight
        self.out_of_time.set()
        while self.in_flight:  # each ends at once: its relay is cancelled, its client told
            await asyncio.sleep(0.05)
        return ended

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await _lifespan(receive, send)
        if self.draining or not self.opened:
            why = "the server is shutting down" if self.draining else "the server is starting"
            return await error_response(why, 503, headers={"Retry-After": "1"})(scope, receive, send)
        self.in_flight += 1
        try:
            await self._serve(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def _serve(self, scope, receive, send):
        stopped = "the server shut down before the generation finished"
        try:
            finished, body = await self._unless_stopped(
                asyncio.wait_for(_read_body(receive, self.max_body_bytes), self.body_timeout))
            if not finished:
                return await error_response(stopped, 503)(scope, receive, send)
        except asyncio.TimeoutError:
            return await error_response(f"the request body did not arrive within {self.body_timeout:g} seconds", 408,
                                        headers={"Connection": "close"})(scope, receive, send)
        except BodyTooLarge:
            return await error_response(f"the request body is larger than {self.max_body_bytes} bytes",
                                        413)(scope, receive, send)
        except ClientLeft:
            return
        request = Forwarded(scope["method"], scope["path"], scope.get("query_string", b""), list(scope["headers"]),
                            body, tuple(scope["client"]) if scope.get("client") else None,
                            scope.get("http_version", "1.1"))
        wanted = affinity(request.headers, body)
        for attempt in range(RESUBMITS + 1):
            relay = Relay(send, attempt)
            try:
                finished, _ = await self._unless_stopped(
                    relay.run(self.replicas.forward.remote(request, affinity=wanted)))
                if not finished:
                    return await (relay.cut(stopped) if relay.sent_body
                                  else error_response(stopped, 503)(scope, receive, send))
            except BackPressureError:
                return await error_response("the server is busy: too many requests are waiting",
                                            429)(scope, receive, send)
            except (ActorDiedError, ActorUnavailableError, RayActorError) as error:
                if not relay.sent_body:
                    continue  # nothing reached the client: another replica generates it
                return await relay.cut(f"the replica serving this request stopped: {type(error).__name__}")
            except Exception as error:  # a failure inside the replica, or of the transport
                if relay.sent_body:
                    return await relay.cut(f"generation failed: {type(error).__name__}")
                return await error_response(f"the replica failed: {type(error).__name__}", 500)(scope, receive, send)
            if not relay.sent_body:
                return await error_response("the replica ended without a reply", 500)(scope, receive, send)
            return
        await error_response("no replica could serve this request: each one tried stopped", 503)(scope, receive, send)

    async def _unless_stopped(self, work) -> tuple[bool, object]:
        """(True, what `work` returns), or (False, None) when a drain runs out of time first. Work
        that does not finish (the drain's time is up, or this request is cancelled: its client left)
        is cancelled: a relay's replica then drops the generation."""
        run = asyncio.ensure_future(work)
        stop = asyncio.ensure_future(self.out_of_time.wait())
        try:
            await asyncio.wait({run, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not run.done():
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)
        return (True, run.result()) if not run.cancelled() else (False, None)


class Relay:
    """Sends a replica's ASGI messages to the client, holding back the response head, and a
    stream's events that carry no text yet (a chat stream's role chunk), until the first text: until
    then nothing has reached the client and the request can be resubmitted."""

    def __init__(self, send, resubmits: int = 0):
        self.send, self.head, self.sent_body, self.resubmits = send, None, False, resubmits

    async def run(self, messages) -> None:
        held = []
        try:
            async for message in messages:
                if message["type"] == "http.response.start":
                    self.head = message
                elif self.sent_body:
                    await self.send(message)
                elif message.get("more_body") and _no_text_yet(message.get("body", b"")):
                    held.append(message)
                else:
                    await self.send({**self.head, "headers": [*self.head["headers"],
                                                              (RESUBMITS_HEADER, str(self.resubmits).encode())]})
                    self.sent_body = True
                    for earlier in [*held, message]:
                        await self.send(earlier)
        finally:  # however this ends, the replica stops working for it
            messages.cancel()

    async def cut(self, why: str) -> None:
        """End a reply whose replica died midway: a stream gets an error event and [DONE]."""
        streaming = any(name.lower() == b"content-type" and value.startswith(b"text/event-stream")
                        for name, value in self.head["headers"])
        if streaming:
            events = error_event(why, "unavailable") + "data: [DONE]\n\n"
            await self.send({"type": "http.response.body", "body": events.encode(), "more_body": False})
        else:
            await self.send({"type": "http.response.body", "body": b"", "more_body": False})


def _no_text_yet(body: bytes) -> bool:
    """Whether a stream's event carries no generated text (nor an end or an error)."""
    if not body.startswith(b"data: {"):
        return False
    try:
        event = json.loads(body[6:])
    except ValueError:
        return False
    return "error" not in event and all(not choice.get("text") and not (choice.get("delta") or {}).get("content")
                                        and choice.get("finish_reason") is None for choice in event.get("choices", []))


class BodyTooLarge(Exception):
    pass


class ClientLeft(Exception):
    pass


async def _lifespan(receive, send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _read_body(receive, limit: int) -> bytes:
    """The request body (BodyTooLarge past `limit` bytes, ClientLeft if the client went first)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientLeft
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            raise BodyTooLarge
        if not message.get("more_body", False):
            return b"".join(chunks)


# ---------------------------------------------------------------------------- threads and cores
def replica_name() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a replica
        return str(os.getpid())


def replica_rank() -> int:
    try:
        rank = serve.get_replica_context().rank
    except Exception:  # outside a replica
        return 0
    return getattr(rank, "rank", rank) or 0


def pin_cores(threads: int, rank: int) -> None:
    """Pin this process to `threads` cores of its own (by the replica's rank, round the cores this
    process may use): `num_cpus` reserves cores in Ray's books but pins nothing."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[(rank * threads + i) % len(cores)] for i in range(min(threads, len(cores)))})


# ---------------------------------------------------------------------------- building the app
def build(options: dict) -> serve.Application:
    """The app builder for `serve run specdec.server.replicas:build key=value ...` (or a Serve
    config's `args`): the keys are `specdec serve`'s long options (target, draft, threads,
    max_batch, replicas, max_replicas, api_key, ...), read as the CLI reads them (`config.serve_config`)."""
    return application(serve_config(options))


def replica_threads(config: ServeConfig) -> int:
    """--threads, else the cores this process may use shared by the most replicas that may run."""
    return config.decoder.runtime.threads or max(1, len(os.sched_getaffinity(0))
                                                 // (config.max_replicas or config.replicas or 1))


def application(config: ServeConfig, opened: bool = True) -> serve.Application:
    """The ingress bound to the replicas `config` describes. Each replica gets --threads cores
    (default: the machine's cores / replicas); the cost profile is measured here, once, before any
    replica starts (replicas timing themselves at once would spoil each other's figures).
    opened False: the ingress answers 503 until its `open` is called."""
    replicas, threads = config.replicas or 1, replica_threads(config)
    # the batch each replica runs, decided here once: Ray's max_ongoing_requests must be the same
    config = replace(config, decoder=with_runtime(config.decoder, threads=threads), max_batch=max_batch(config))
    build_decoder(replace(config.decoder, prefix_cache=0))  # reads or measures the profile the replicas will read
    scaling = ({"autoscaling_config": {"min_replicas": replicas, "max_replicas": config.max_replicas,
                                       "initial_replicas": replicas,
                                       "target_ongoing_requests": max(1, config.max_batch // 2),
                                       "upscale_delay_s": 2, "downscale_delay_s": 10}}
               if config.max_replicas else {"num_replicas": replicas})
    replica = serve.deployment(Replica, name="specdec-replica", max_ongoing_requests=config.max_batch,
                               max_queued_requests=config.max_queue,
                               health_check_period_s=5, graceful_shutdown_timeout_s=config.shutdown_timeout + 5,
                               ray_actor_options={"num_cpus": threads,
                                                  "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads)}}},
                               request_router_config=RequestRouterConfig(request_router_class=ConversationRouter),
                               **scaling)
    # the ingress holds every request until a replica answers it: those running and those waiting (and a drain call)
    ingress = serve.deployment(IngressHost, name="specdec-ingress",
                               max_ongoing_requests=(config.max_queue
                                                     + config.max_batch * (config.max_replicas or replicas) + 1),
                               graceful_shutdown_timeout_s=config.shutdown_timeout + 5,
                               ray_actor_options={"num_cpus": 0})
    return ingress.bind(replica.bind(config), opened)


@serve.ingress()
class IngressHost:
    """Serve's ingress deployment around Ingress (`serve.ingress` wants a class without __call__;
    the ASGI app it serves is built in the replica, after the constructor)."""

    def __init__(self, replicas, opened: bool = True):
        self.ingress = Ingress(replicas, opened=opened)

    def __serve_build_asgi_app__(self):
        return self.ingress

    def open(self) -> None:
        self.ingress.opened = True

    async def drain(self, timeout: float) -> int:
        return await self.ingress.drain(timeout)


# ---------------------------------------------------------------------------- specdec serve --replicas
class NotServing(BaseException):
    """A signal came before the ingress was opened: what was starting stops (a BaseException, as
    KeyboardInterrupt is, so that no `except Exception` on the way swallows it)."""


class Signals:
    """SIGTERM and SIGINT for `run_local`. Before the ingress is opened a signal raises NotServing
    (nothing was served: whatever is starting unwinds); once it is open, the first asks for a drain
    (`requested`), a second raises KeyboardInterrupt (stop now). `install` again after `ray.init`,
    which puts in its own (one that exits, then a fatal-signal handler that aborts the process)."""

    def __init__(self):
        self.requested = threading.Event()
        self.serving = False

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, *_):
        if self.requested.is_set():
            raise KeyboardInterrupt
        self.requested.set()
        if not self.serving:
            raise NotServing


def run_local(config: ServeConfig) -> None:
    """`specdec serve --replicas N`: a local Ray instance (no dashboard: its jobs API runs arbitrary
    code), the app on --host:--port; runs until SIGTERM or Ctrl-C, then drains (`Ingress.drain`,
    up to --shutdown-timeout); a second signal stops at once. The ingress opens (its first 200) only
    once this process's handlers are in place: a signal at any moment after that drains."""
    import ray
    import ray._private.ray_constants as ray_constants

    signals = Signals()
    signals.install()
    # Ray's failure-signal handler would abort this process on SIGTERM while ray.init runs; Ray's
    # own Python handler then exits instead (SystemExit), which unwinds as NotServing does
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    try:
        app = application(config, opened=False)
        ray.init(num_cpus=len(os.sched_getaffinity(0)), include_dashboard=False, dashboard_host="127.0.0.1",
                 _node_ip_address="127.0.0.1", log_to_driver=False, configure_logging=False)
        signals.install()
        serve.start(http_options={"host": config.host, "port": config.port}, logging_config={"log_level": "WARNING"})
        serve.run(app, name="specdec", route_prefix="/")
        signals.serving = True  # from here a signal drains: the ingress may answer
        serve.get_app_handle("specdec").open.remote().result(timeout_s=60)
        print(f"specdec: serving on http://{config.host}:{config.port}/v1 with {config.replicas} Ray Serve replica(s) "
              f"of {replica_threads(config)} thread(s)" + (f", up to {config.max_replicas}" if config.max_replicas
                                                           else ""), file=sys.stderr)
        serve_until_signalled(signals, config.shutdown_timeout)
    except NotServing:
        print("specdec: stopped before serving", file=sys.stderr)
    except SystemExit as exit:
        if exit.code != signal.SIGTERM:  # Ray's handler while ray.init ran: sys.exit(signal number)
            raise
        print("specdec: stopped before serving", file=sys.stderr)
    except KeyboardInterrupt:
        pass
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()


def serve_until_signalled(signals: Signals, shutdown_timeout: float) -> None:
    """Wait for a signal, then drain the ingress (see `Ingress.drain`)."""
    while not signals.requested.wait(1):
        pass
    try:
        ended = (serve.get_app_handle("specdec").drain.remote(shutdown_timeout)
                 .result(timeout_s=shutdown_timeout + 30))
        print(f"specdec: drained; {ended} request(s) still running at the deadline were ended", file=sys.stderr)
    except KeyboardInterrupt:  # a second signal: stop now
        pass
    except Exception as error:  # the drain itself failed or hung: stop anyway
        print(f"specdec: the drain did not finish ({type(error).__name__}); stopping", file=sys.stderr)
