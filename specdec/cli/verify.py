"""`specdec verify`: the losslessness check (`specdec.losslessness`) on the user's models and settings."""

from __future__ import annotations

import json

from specdec.cli.arguments import add_model_arguments, add_sampling_arguments, decoder_config, sampling_params
from specdec.config import check_verify_settings
from specdec.errors import SpecDecError


def add_parser(commands) -> None:
    v = commands.add_parser(
        "verify", help="check that speculative decoding matches plain decoding on your models and settings",
        description="Sample short continuations with plain and with speculative decoding and compare their "
                    "distributions (chi-square and total variation, Bonferroni over prompts); print PASS or FAIL. "
                    "Exits 1 on FAIL. Temperature 0 compares the greedy continuations token for token.",
    )
    v.add_argument("--prompt", action="append", default=None,
                   help="prompt (repeatable; default: three short code prompts)")
    add_model_arguments(v)
    add_sampling_arguments(v)
    v.add_argument("--seed", type=int, default=0, help="base seed; every sample gets its own (default 0)")
    v.add_argument("--samples", type=int, default=1000, help="continuations per prompt and decoder (default 1000)")
    v.add_argument("--length", type=int, default=None,
                   help="tokens per continuation (default: the draft depth + 1, so every draft position is verified)")
    v.add_argument("--alpha", type=float, default=1e-3,
                   help="probability that a lossless decoder fails the check (default 0.001)")
    v.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    v.set_defaults(run=run_verify)


def run_verify(args) -> None:
    check_verify_settings(args.samples, 1 if args.length is None else args.length, args.alpha, args.seed)
    sampling = sampling_params(args)  # fails before anything loads
    config = decoder_config(args, prefix_cache=0)
    from specdec.build import build_decoder
    from specdec.losslessness import DEFAULT_PROMPTS, check_lossless, failure_summary, format_report

    decoder = build_decoder(config)
    report = check_lossless(decoder, args.prompt or DEFAULT_PROMPTS, samples=args.samples, length=args.length,
                            sampling=sampling, seed=args.seed, alpha=args.alpha)
    print(json.dumps(report.to_dict()) if args.json else format_report(report))
    if not report.passed:
        raise SpecDecError(failure_summary(report))
