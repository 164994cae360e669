"""uvicorn for `specdec serve`: bounded shutdown, and deadlines a slow client cannot stretch."""

from __future__ import annotations

import threading

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT = 10.0  # seconds for a request head to arrive, from connecting or from the last response
KEEP_ALIVE_TIMEOUT = 5  # seconds an idle keep-alive connection stays open


class Server(uvicorn.Server):
    """uvicorn, shutting down in bounded time: on SIGTERM/SIGINT the batch refuses new requests
    (503, and /health answers 503), ends waiting ones with an error event and gives running ones
    `shutdown_timeout` seconds before they end with an error event too (streams still get their
    `[DONE]`). The server keeps accepting connections while it drains, so that a new request gets
    its 503 rather than a refused connection; then uvicorn shuts down. A second signal ends every
    running generation (with an error event) and exits without waiting for connections."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout: float):
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout
        self.draining: threading.Thread | None = None

    def handle_exit(self, sig, frame) -> None:
        if self.draining is None:
            self.draining = threading.Thread(target=self._drain, args=(sig,), daemon=True)
            self.draining.start()
            return
        self.config.app.state.service.stop_now()
        super().handle_exit(sig, frame)
        self.force_exit = True

    def _drain(self, sig) -> None:
        try:
            self.config.app.state.service.drain(self.shutdown_timeout)
        finally:
            super().handle_exit(sig, None)  # uvicorn's main loop sees should_exit within 0.1 s


class HeaderDeadline(H11Protocol):
    """h11 with a deadline for each request head: a connection that has not sent a complete head
    within HEADER_TIMEOUT of connecting, or of its last response, is closed (uvicorn's keep-alive
    timer stops at the first byte, so a client sending a head byte by byte held it forever)."""

    header_timeout = HEADER_TIMEOUT
    _deadline = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:  # a head arrived
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.header_timeout, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
            self.transport.close()


def config(app: FastAPI, host: str, port: int, shutdown_timeout: float = 10.0,
           max_connections: int = 256) -> uvicorn.Config:
    """Deadlines for heads (HEADER_TIMEOUT), bodies (the app's) and idle keep-alive connections; at
    most `max_connections` open connections (more get 503)."""
    return uvicorn.Config(app, host=host, port=port, log_level="warning", http=HeaderDeadline,
                          timeout_keep_alive=KEEP_ALIVE_TIMEOUT, limit_concurrency=max_connections,
                          timeout_graceful_shutdown=int(shutdown_timeout) + 3)  # a backstop


def serve(app: FastAPI, host: str, port: int, shutdown_timeout: float = 10.0, max_connections: int = 256) -> None:
    Server(config(app, host, port, shutdown_timeout, max_connections), shutdown_timeout).run()
