"""A ServeConfig (`specdec.config`) into a running Service and its routes: what `specdec serve` and
each Ray Serve replica start from."""

from __future__ import annotations

import os
from dataclasses import replace

from fastapi import FastAPI

from specdec.build import build_decoder
from specdec.config import DEFAULT_BATCH, ServeConfig
from specdec.decoder import SpeculativeDecoder
from specdec.errors import SpecDecError
from specdec.runtime import Placement, placement
from specdec.server.app import routes
from specdec.server.service import Service


def target_placement(config: ServeConfig) -> Placement:
    """Where the target will run, known before it loads (no target: the demo pair). llama.cpp sizes
    its KV cells by the batch at load, and Ray Serve needs the batch before any replica starts."""
    return placement(config.decoder.target, config.decoder.runtime)


def on_gpu(config: ServeConfig) -> bool:
    """Whether the target will run on a GPU (its batch is then a GPU's)."""
    return target_placement(config).on_gpu


def max_batch(config: ServeConfig) -> int:
    return config.batch(on_gpu(config))


def build_service(config: ServeConfig) -> Service:
    """The Service `config` describes: models loaded, the forward costs read (or measured), the
    batch thread started."""
    batch = max_batch(config)
    # llama.cpp sizes its KV cells for every slot at load; a transformers static pool grows on demand,
    # so it starts with a CPU batch's rows (a GPU batch's 65 rows of an 8B model's KV are ~33 GB up front)
    draft = config.decoder.drafter.draft
    fixed = target_placement(config).fixed_slots or (
        draft is not None and placement(draft, config.decoder.runtime).fixed_slots)
    slots = batch if fixed else min(batch, DEFAULT_BATCH["cpu"])
    decoder = build_decoder(replace(config.decoder, slots=slots))
    check_sequence_ids(decoder, batch)
    name = config.model_name or os.path.basename(os.path.normpath(decoder.target.path))
    return Service(decoder, name, max_queue=config.max_queue, max_batch=batch,
                   depth="measure" if config.batch_depth == "measured" else None)


def build_app(config: ServeConfig, service: Service) -> FastAPI:
    """The routes over `service`, secured as `config` says."""
    return routes(service, api_keys=config.api_keys, allowed_origins=config.allowed_origins,
                  keys_share_caches=config.keys_share_caches, metrics_key=config.metrics_key,
                  public_metrics=config.public_metrics,
                  allowed_hosts=["127.0.0.1", "localhost", "::1"] if config.loopback else None)


def check_sequence_ids(decoder: SpeculativeDecoder, batch: int) -> None:
    """On llama.cpp every running generation takes a sequence id of each model, and every tree branch one more."""
    from specdec.runtime.prefix import MAX_KEPT

    drafter = decoder.drafter
    tree = drafter.tree if drafter is not None else None
    models = [decoder.target] + ([decoder.draft_model] if decoder.draft_model else [])
    per_generation = drafter.sequence_ids if drafter is not None else 1
    kept = MAX_KEPT if decoder.prefixes is not None else 0  # the prefix cache's sequences, on the target
    limit = min((model.max_sequence_ids for model in models if model.max_sequence_ids is not None), default=None)
    if limit is not None and batch * per_generation + kept > limit:
        what = f"with {tree.nodes}-node trees " if tree is not None else ""
        raise SpecDecError(f"{batch} generations {what}need up to {batch * per_generation + kept} llama.cpp "
                           f"sequence ids; it has {limit}: use --max-batch {(limit - kept) // per_generation} or fewer"
                           + (", or a smaller --tree" if tree is not None else ""))
