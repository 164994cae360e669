"""What `specdec serve` holds at idle, and whether its prefix cache still pays (issue 39):

    python benchmarks/idle_memory.py                                  # the demo pair, --threads 1
    python benchmarks/idle_memory.py --prefix-cache-tokens 0          # any `specdec serve` flags

Resident memory (VmRSS) 3 s after /health first answers 200, and again after two 16-token requests;
then a 924-token prompt (the first 3,000 characters of specdec/decoder.py) sent three times with
max_tokens 1: each time to the reply and the prompt tokens served from the prefix cache. Prints one
Markdown row.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx

from isolation_probe import specdec_server

PROMPT = (Path(__file__).parents[1] / "specdec" / "decoder.py").read_text()[:3000]


def resident_mb(pid: int) -> int:
    line = next(line for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS"))
    return int(line.split()[1]) // 1024


def complete(url: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    started = time.perf_counter()
    reply = httpx.post(url + "/v1/completions", timeout=120,
                       json={"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    reply.raise_for_status()
    return time.perf_counter() - started, reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def main() -> None:
    with specdec_server(*sys.argv[1:]) as (server, url):
        time.sleep(3)
        idle = resident_mb(server.pid)
        for _ in range(2):
            complete(url, "def f(x):", 16)
        time.sleep(3)
        after = resident_mb(server.pid)
        repeats = [complete(url, PROMPT, 1) for _ in range(3)]
    times = " / ".join(f"{seconds:.2f}" for seconds, _ in repeats)
    cached = " / ".join(str(tokens) for _, tokens in repeats)
    print("| flags | RSS idle, MB | after 2 requests | 924-token prompt ×3, s | cached tokens |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| `{' '.join(sys.argv[1:]) or '(defaults)'}` | {idle} | {after} | {times} | {cached} |")


if __name__ == "__main__":
    main()
