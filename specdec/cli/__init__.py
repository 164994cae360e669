"""The `specdec` command: argv into configurations, then the library; each subcommand in a module
of its own (`add_parser` declares it, `run_*` runs it)."""

from __future__ import annotations

import argparse
import os
import sys

from specdec.cli import bench, demo, generate, serve, train, verify
from specdec import __version__
from specdec.errors import SpecDecError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding for local "
                                                                 "Hugging Face checkpoints and GGUF files.")
    parser.add_argument("--version", action="version", version=f"specdec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo.add_parser(commands)
    generate.add_parsers(commands)  # generate, ngram build, profile
    bench.add_parser(commands)
    train.add_parser(commands)
    verify.add_parser(commands)
    serve.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except SpecDecError as error:
        print(f"specdec: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("specdec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`specdec generate ... | head`): not our error
        sys.stdout = open(os.devnull, "w")
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
