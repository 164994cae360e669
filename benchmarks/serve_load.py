"""A short load run against `specdec serve`: concurrent streaming clients, errors, tokens/s, memory.

    python benchmarks/serve_load.py --clients 8 --requests 4 --max-tokens 64      # the demo pair

Starts the server as a subprocess (any `specdec serve` model flags after `--`), waits for
/health, sends `clients` × `requests` streamed completions (sampled, T 0.8) from threads, and
prints one JSON object: requests, errors, generated tokens, wall seconds, tokens/s, the server's
resident memory before and after, and its /metrics acceptance rate.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4, help="per client")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("serve_args", nargs="*", help="model flags for `specdec serve` (after --)")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "specdec", "serve", "--port", str(port), "--model-name", "m",
                               "--max-queue", str(args.clients * 2), *args.serve_args])
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        before = rss_mb(server.pid)
        prompts = ["def fibonacci(n):", "import os\n\ndef list_files(path):", "class Stack:\n    def __init__(self):",
                   "def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\""]

        def client(i: int) -> tuple[int, int]:
            tokens = errors = 0
            with httpx.Client(timeout=300) as http:
                for j in range(args.requests):
                    body = {"model": "m", "prompt": prompts[(i + j) % len(prompts)], "max_tokens": args.max_tokens,
                            "temperature": 0.8, "top_k": 20, "seed": i * 100 + j, "stream": True,
                            "stream_options": {"include_usage": True}}
                    try:
                        with http.stream("POST", url + "/v1/completions", json=body) as response:
                            if response.status_code != 200:
                                errors += 1
                                continue
                            for line in response.iter_lines():
                                if line.startswith("data: {") and '"usage"' in line:
                                    tokens += json.loads(line[6:])["usage"]["completion_tokens"]
                    except httpx.HTTPError:
                        errors += 1
            return tokens, errors

        started = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            results = list(pool.map(client, range(args.clients)))
        seconds = time.perf_counter() - started
        metrics = httpx.get(url + "/metrics").text
        acceptance = next(float(l.split()[-1]) for l in metrics.splitlines() if l.startswith("specdec_acceptance_rate "))
        tokens = sum(t for t, _ in results)
        print(json.dumps({
            "clients": args.clients, "requests": args.clients * args.requests, "errors": sum(e for _, e in results),
            "generated_tokens": tokens, "seconds": round(seconds, 2), "tokens_per_second": round(tokens / seconds, 1),
            "rss_mb_before": round(before, 1), "rss_mb_after": round(rss_mb(server.pid), 1), "acceptance_rate": round(acceptance, 3),
        }))
    finally:
        server.terminate()
        server.wait(timeout=10)


if __name__ == "__main__":
    main()
