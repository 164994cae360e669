"""`specdec serve`: argv into a ServeConfig, then one process under uvicorn or Ray Serve replicas."""

from __future__ import annotations

import os
import socket
import sys

from specdec.cli.arguments import add_model_arguments, add_options, config_options
from specdec.config import CHAT_OPTIONS, SERVE_OPTIONS, check_model_paths, serve_config
from specdec.errors import SpecDecError


def add_parser(commands) -> None:
    serve = commands.add_parser("serve", help="serve the models over an OpenAI-compatible HTTP API",
                                description="POST /v1/completions and /v1/chat/completions (streaming or not), "
                                            "GET /v1/models, /health, /metrics. Continuous batching: up to "
                                            "--max-batch generations advance together, one target forward per step; "
                                            "the others wait in a bounded FIFO queue.")
    add_model_arguments(serve)
    add_options(serve, SERVE_OPTIONS)
    add_options(serve, CHAT_OPTIONS)
    serve.set_defaults(run=run_serve)


def check_port_free(host: str, port: int) -> None:
    """Refuse a port another process listens on, before the models load and anything says "serving"."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as error:
        why = os.strerror(error.errno) if error.errno else str(error)
        raise SpecDecError(f"cannot listen on {host}:{port}: {why} (choose another --port, or stop what uses "
                           "it)") from None


def run_serve(args) -> None:
    config = serve_config(config_options(args))
    check_model_paths(config.decoder)
    check_port_free(config.host, config.port)
    if config.replicas is not None:
        try:
            from specdec.server.replicas import run_local
        except ImportError as error:
            raise SpecDecError(f"--replicas runs Ray Serve, which is not installed ({error}): "
                               "pip install -e \".[ray]\"") from None
        return run_local(config)
    from specdec.server import serve
    from specdec.server.build import build_app, build_service

    service = build_service(config)
    decoder = service.decoder
    print(f"specdec: serving {service.model_name!r} on http://{config.host}:{config.port}/v1 (drafter: "
          f"{decoder.drafter.name if decoder.drafter else 'none'}, up to {service.batcher.max_batch} generations "
          "at once)", file=sys.stderr)
    try:
        serve(build_app(config, service), host=config.host, port=config.port, shutdown_timeout=config.shutdown_timeout,
              max_connections=config.max_connections)
    except SystemExit as error:  # uvicorn logs why it could not start (a port in use, say), then exits
        if error.code:
            raise SpecDecError(f"the server could not start on {config.host}:{config.port} "
                               "(see the message above)") from None
