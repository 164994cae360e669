"""`specdec serve`: argv into a ServeConfig, then one process under uvicorn or Ray Serve replicas."""

from __future__ import annotations

import sys

from specdec.cli.arguments import GIVEN, add_model_arguments, config_options, positive
from specdec.config import DEFAULT_BATCH, SERVER_PREFIX_TOKENS, ServeConfig, serve_config
from specdec.drafters.history import DEFAULT_TOKENS as HISTORY_TOKENS
from specdec.errors import SpecDecError


def add_parser(commands) -> None:
    serve = commands.add_parser("serve", help="serve the models over an OpenAI-compatible HTTP API",
                                description="POST /v1/completions and /v1/chat/completions (streaming or not), "
                                            "GET /v1/models, /health, /metrics. Continuous batching: up to "
                                            "--max-batch generations advance together, one target forward per step; "
                                            "the others wait in a bounded FIFO queue.")
    add_model_arguments(serve)
    defaults = ServeConfig()
    serve.add_argument("--host", default=GIVEN, help=f"default {defaults.host}")
    serve.add_argument("--port", type=int, default=GIVEN, help=f"default {defaults.port}")
    serve.add_argument("--model-name", default=GIVEN,
                       help="the model id clients send (default: the target directory's name)")
    serve.add_argument("--max-queue", type=positive, default=GIVEN,
                       help=f"requests that may wait; more get 429 (default {defaults.max_queue})")
    serve.add_argument("--max-batch", type=positive, default=GIVEN,
                       help=f"generations that run together (default {DEFAULT_BATCH['cpu']} on a CPU, "
                            f"{DEFAULT_BATCH['gpu']} on a GPU)")
    serve.add_argument("--batch-depth", choices=["measured", "fixed"], default=GIVEN,
                       help="with a numeric --gamma: measured (default) caps the draft depth of each step for the "
                            "batch size, from measured forward costs and the acceptance so far (no drafting when it "
                            "does not pay); fixed: always --gamma. "
                            "(--gamma auto, the default, sizes every row's draft for the batch itself.)")
    serve.add_argument("--shutdown-timeout", type=float, default=GIVEN, metavar="SECONDS",
                       help="on SIGTERM/SIGINT, how long running generations may finish before they end with an error "
                            f"(default {defaults.shutdown_timeout:g})")
    serve.add_argument("--api-key", action="extend", nargs="+", default=GIVEN, metavar="KEY",
                       help="require `Authorization: Bearer KEY` on /v1 routes and /metrics; repeat for several "
                            "tenants, each with caches and histories of its own "
                            "(also $SPECDEC_API_KEY; default: none, one tenant)")
    serve.add_argument("--api-key-file", default=GIVEN, metavar="FILE",
                       help="API keys, one per line (# comments and blank lines ignored), as --api-key")
    serve.add_argument("--keys-share-caches", action="store_true", default=GIVEN,
                       help="all API keys share one scope: a request may reuse the prefix cache and history of any "
                            "key's requests (faster where tenants send the same prompts, but cached_tokens and timing "
                            "then tell one key what another sent)")
    serve.add_argument("--public-metrics", action="store_true", default=GIVEN, help="/metrics needs no API key")
    serve.add_argument("--allowed-origins", nargs="+", default=GIVEN, metavar="ORIGIN",
                       help="browser origins allowed by CORS, e.g. http://localhost:3000 (default: none)")
    serve.add_argument("--chat-template", default=GIVEN, metavar="FILE",
                       help="a Jinja chat template for models without one (or to replace theirs)")
    serve.add_argument("--max-connections", type=positive, default=GIVEN,
                       help=f"open connections at most; more get 503 (default {defaults.max_connections})")
    serve.add_argument("--history-tokens", type=int, default=GIVEN, metavar="N",
                       help="the default drafter also drafts from earlier requests' prompts and outputs, "
                            f"N tokens kept per tenant (a request's `user`; default {HISTORY_TOKENS:,}; 0 = off)")
    serve.add_argument("--share-history", action="store_true", default=GIVEN,
                       help="every request drafts from every tenant's history (faster where tenants repeat each "
                            "other, but a request's speed then tells something of other tenants' requests)")
    serve.add_argument("--prefix-cache-tokens", type=int, default=GIVEN, metavar="N",
                       help="finished requests keep up to N tokens of their caches, and a new request starts from the "
                            "longest prefix it shares with them: a conversation's next turn or a shared system prompt "
                            f"is not computed again (default {SERVER_PREFIX_TOKENS:,}; on llama.cpp that many KV cells "
                            "more; 0 = off)")
    serve.add_argument("--replicas", type=positive, default=GIVEN, metavar="N",
                       help="run N replicas as a Ray Serve application on a local Ray instance "
                            "(pip install -e \".[ray]\"); "
                            "each loads the models and takes --threads cores of its own (default: the cores / N)")
    serve.add_argument("--max-replicas", type=positive, default=GIVEN, metavar="N",
                       help="with --replicas: autoscale between --replicas and N replicas on ongoing requests")
    serve.set_defaults(run=run_serve)


def run_serve(args) -> None:
    config = serve_config(config_options(args))
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
