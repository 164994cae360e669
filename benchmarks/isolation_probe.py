"""Can one request stall the others, and does a request whose client left stop? The outside probe's
reproducers, against `specdec serve` on the demo pair (llama.cpp, 1 thread):

    python benchmarks/isolation_probe.py                  # prints a Markdown table, writes benchmarks/isolation/results.json
    python benchmarks/isolation_probe.py --predictions    # only 6. below (benchmarks/isolation/predictions.json)
    python benchmarks/isolation_probe.py --keys           # only 7. below (benchmarks/isolation/keys.json)

1. light alone: a short greedy request (8 tokens), 5 times; its latency is the yardstick.
2. heavy stops: four stop strings of 200,000 characters (~800 kB) with max_tokens 8, and three light
   requests sent 0.1 s later: the heavy request's time and the light ones' (the probe: 15 s and 14.6 s).
3. long prompt: a ~900-token prompt joining while a light stream runs: that stream's longest gap
   between tokens (the prompt is prefilled in chunks between steps).
4. abandoned: a non-streamed 900-token sampled request on a raw socket closed after 0.5 s: seconds
   until the batch is empty, and whether it was counted as cancelled (the probe: it ran all 900 tokens).
5. storm: 200 such requests from 50 clients, each leaving after 0.5 s: seconds until the batch and
   the queue are empty after the last client left (the probe: 14 s).
6. hostile predictions (issue 30; `--predictions` runs only this): a 16-token greedy request alone
   (median of 5), then again and again while 12 requests of a 201-token prompt and 64 tokens each
   run, first without a prediction (what sharing the batch costs), then each with a 900,000-character
   prediction (" x" * 450000) and usage counted (the probe: 0.13 s alone, 35 s beside them at worst);
   and the slowest of the 12.
7. long texts across keys (issue 39; `--keys` runs only this, the server with API keys A and B): key
   B's 16-token greedy request with a 21,000-character prediction (code) alone (median of 5), then
   again and again while key A's 24 requests with 900,000-character predictions (random letters,
   spaces and newlines) are in flight, and the slowest of A's (the probe: 0.2-0.4 s alone, 6.9 s
   beside them; A's finished one by one out to 75 s).
"""

from __future__ import annotations

import json
import os
import random
import socket
import statistics
import string
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx

from serve_load import free_port

OUT = Path(__file__).parent / "isolation"
LIGHT = {"model": "m", "prompt": "def f(x):", "max_tokens": 8, "temperature": 0}


def metric(url: str, name: str) -> float:
    lines = httpx.get(url + "/metrics", timeout=10).text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name + " ") or line.startswith(name + "{"))


def timed_post(url: str, body: dict, key: str | None = None) -> float:
    started = time.perf_counter()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120)
    response.raise_for_status()
    return time.perf_counter() - started


def post_and_leave(port: int, body: dict, after: float) -> None:
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        time.sleep(after)


def idle_after(url: str, started: float, limit: float = 120) -> float:
    """Seconds from `started` until nothing runs or waits (inf: not within `limit`)."""
    while (health := httpx.get(url + "/health", timeout=10).json())["batch_size"] or health["queue_depth"]:
        if time.perf_counter() - started > limit:
            return float("inf")
        time.sleep(0.02)
    return time.perf_counter() - started


def longest_gap(url: str, body: dict, started: list) -> float:
    """A stream's longest wait between two events; `started` gets the time of its first event."""
    gaps, last = [], None
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                now = time.perf_counter()
                if last is None:
                    started.append(now)
                else:
                    gaps.append(now - last)
                last = now
    return max(gaps)


def probe(url: str, port: int) -> dict:
    figures = {"light alone, s (median of 5)": statistics.median(timed_post(url, LIGHT) for _ in range(5))}
    heavy = {**LIGHT, "stop": ["q" * 200_000] * 4}
    with ThreadPoolExecutor(4) as pool:
        slow = pool.submit(timed_post, url, heavy)
        time.sleep(0.1)
        lights = [pool.submit(timed_post, url, LIGHT) for _ in range(3)]
        figures["heavy stops: the heavy request, s"] = slow.result()
        figures["heavy stops: light beside it, s (max of 3)"] = max(f.result() for f in lights)
    stream_body = {**LIGHT, "max_tokens": 200, "stop": ["\n\n\n\n"]}
    figures["long prompt: light stream's longest gap alone, s"] = longest_gap(url, stream_body, [])
    long_prompt = {**LIGHT, "prompt": "def f(x):\n" + "    x = x + 1  # step\n" * 90, "max_tokens": 4}
    with ThreadPoolExecutor(2) as pool:
        first_event = []
        gap = pool.submit(longest_gap, url, stream_body, first_event)
        while not first_event:
            time.sleep(0.005)
        figures["long prompt: ~900-token prompt, s"] = pool.submit(timed_post, url, long_prompt).result()
        figures["long prompt: light stream's longest gap beside it, s"] = gap.result()
    abandoned = {**LIGHT, "max_tokens": 900, "temperature": 1, "seed": 0}  # seed 0 runs all 900 tokens (~5 s) on the demo pair
    cancelled = metric(url, "specdec_cancelled_total")
    post_and_leave(port, abandoned, 0.5)
    figures["abandoned: seconds after the client left until idle"] = idle_after(url, time.perf_counter())
    figures["abandoned: counted as cancelled"] = metric(url, "specdec_cancelled_total") - cancelled
    with ThreadPoolExecutor(50) as pool:
        list(pool.map(lambda i: post_and_leave(port, {**abandoned, "seed": i}, 0.5), range(200)))  # 429s once 64 wait
    figures["storm of 200: seconds after the last client left until idle"] = idle_after(url, time.perf_counter())
    return figures


SIXTEEN = {**LIGHT, "max_tokens": 16}
CROWD = {"model": "m", "prompt": "x" + " x" * 200, "max_tokens": 64, "temperature": 0}
HOSTILE = {**CROWD, "prediction": {"type": "content", "content": " x" * 450_000}}


def beside(url: str, crowd: dict) -> tuple[list[float], float]:
    """The 16-token request's times, sent one after another from 0.1 s after 12 `crowd` requests
    until those have all been answered, and the slowest of the crowd's."""
    with ThreadPoolExecutor(12) as pool:
        others = [pool.submit(timed_post, url, crowd) for _ in range(12)]
        time.sleep(0.1)
        lights = []
        while not all(f.done() for f in others):
            lights.append(timed_post(url, SIXTEEN))
        return lights, max(f.result() for f in others)


def predictions(url: str) -> dict:
    figures = {"16 tokens alone, s (median of 5)": statistics.median(timed_post(url, SIXTEEN) for _ in range(5))}
    for name, crowd in (("12 plain requests", CROWD), ("12 hostile predictions", HOSTILE)):
        lights, slowest = beside(url, crowd)
        figures[f"16 tokens beside {name}, s (median of {len(lights)})"] = statistics.median(lights)
        figures[f"16 tokens beside {name}, s (slowest of {len(lights)})"] = max(lights)
        figures[f"{name}: the slowest of them, s"] = slowest
    return figures


def across_keys(url: str) -> dict:
    code = (Path(__file__).parents[1] / "specdec" / "decoder.py").read_text()
    legit = {**SIXTEEN, "prediction": {"type": "content", "content": (code * 2)[:21_000]}}
    rng = random.Random(1)
    hostile = {**SIXTEEN, "prediction": {"type": "content", "content": "".join(
        rng.choice(string.ascii_letters + " \n") for _ in range(900_000))}}
    timed_post(url, legit, "B")  # warm
    figures = {"B alone, s (median of 5)": statistics.median(timed_post(url, legit, "B") for _ in range(5))}
    with ThreadPoolExecutor(24) as pool:
        attack = [pool.submit(timed_post, url, hostile, "A") for _ in range(24)]
        time.sleep(1.0)
        times = []
        while not all(f.done() for f in attack):
            times.append(timed_post(url, legit, "B"))
        figures[f"B beside A's 24, s (median of {len(times)})"] = statistics.median(times)
        figures[f"B beside A's 24, s (slowest of {len(times)})"] = max(times)
        figures["A's 24: the slowest, s"] = max(f.result() for f in attack)
    return figures


@contextmanager
def specdec_server(*flags: str):
    """`specdec serve` on the demo pair (model id "m", 1 thread, `flags` more) until the block ends:
    yields (its process, its URL) once /health answers 200."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "specdec", "serve", "--port", str(port), "--model-name", "m",
                               "--threads", "1", *flags], stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.time() > deadline:
                raise SystemExit("specdec serve did not come up")
            time.sleep(0.2)
        yield server, url
    finally:
        server.terminate()
        server.wait(30)


def main() -> None:
    mode = next((m for m in ("predictions", "keys") if f"--{m}" in sys.argv), None)
    with specdec_server(*(["--api-key", "A", "B"] if mode == "keys" else [])) as (_, url):
        port = int(url.rsplit(":", 1)[1])
        figures = {"predictions": predictions, "keys": across_keys}[mode](url) if mode else probe(url, port)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    record = {"cpu": cpu, "load_after": os.getloadavg()[0], **figures}
    OUT.mkdir(exist_ok=True)
    (OUT / f"{mode or 'results'}.json").write_text(json.dumps(record, indent=1))
    print(f"| probe ({cpu}, load {record['load_after']:.2f}) | value |\n| --- | --- |")
    for name, value in figures.items():
        print(f"| {name} | {'> 120' if value == float('inf') else f'{value:.3g}'} |")


if __name__ == "__main__":
    main()
