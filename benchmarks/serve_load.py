"""Load runs against OpenAI-compatible servers: concurrent streaming clients, throughput and latency.

    python benchmarks/serve_load.py --clients 1 4 16 64 --max-tokens 64            # the demo pair, every system
    python benchmarks/serve_load.py --systems specdec specdec-serial --clients 16    # a subset
    python benchmarks/serve_load.py --systems specdec specdec-wide specdec-replicas --clients 16 --modes greedy   # scaling out

Systems (each started as a subprocess on the demo pair's GGUF files unless named -hf):
- specdec:          `specdec serve` as shipped: continuous batching, depth from the measured cost curve;
- specdec-serial:   `specdec serve --max-batch 1 --batch-depth fixed`: one generation at a time, as before batching;
- specdec-hf / specdec-hf-serial: the same on transformers (the HF checkpoints);
- specdec-wide:     `specdec serve` with twice the threads, in one process;
- specdec-replicas: `specdec serve --replicas 2`, each replica with `--threads` threads on cores of its own
                    (Ray Serve; the CPU time of Ray's own processes over the window is recorded);
- llama-server:     llama.cpp's server with the draft model (`-md`, speculation on) and `--parallel` = clients;
- llama-server-plain: llama.cpp's server without speculation.
Every server gets the same threads (`--threads`). For each client count and mode (greedy, sampled
T 0.8 top-k 20), every client sends its requests one after another, streamed; the script records
aggregate completion tokens/s over the window, per-request time to first token and mean inter-token
latency (p50, p99), errors, and the machine's load average. Results go to a JSON file and a Markdown
table (benchmarks/serve-load/).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from specdec.demo import demo_gguf
from specdec.bench.prompts import humaneval_prompts

HERE = Path(__file__).parent
LLAMA_SERVER = HERE.parent / "llama.cpp-src" / "build" / "bin" / "llama-server"
MODES = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.8, "top_k": 20}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(system: str, port: int, threads: int, clients: int, target: str | None = None) -> list[str]:
    target, draft = target or demo_gguf("target"), demo_gguf("draft")
    if system.startswith("specdec"):
        specdec = [sys.executable, "-m", "specdec", "serve", "--port", str(port), "--model-name", "m",
                   "--threads", str(2 * threads if system == "specdec-wide" else threads), "--max-queue", "256"]
        if system != "specdec-hf" and str(target) != str(demo_gguf("target")):
            specdec += ["--target", str(target)]
        if system == "specdec-replicas":
            specdec += ["--replicas", "2"]
        if "-hf" in system:
            specdec += ["--backend", "transformers"]
        if system.endswith("-serial"):
            specdec += ["--max-batch", "1", "--batch-depth", "fixed"]
        return specdec
    if not LLAMA_SERVER.is_file():
        raise SystemExit(f"{LLAMA_SERVER} is missing: run benchmarks/build_llama_cpp_tools.sh")
    llama = [str(LLAMA_SERVER), "-m", str(target), "--port", str(port), "-t", str(threads), "-tb", str(threads),
             "--parallel", str(clients), "-c", str(1024 * clients), "--alias", "m", "--no-webui", "-lv", "0"]
    if system == "llama-server":
        llama += ["-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max", "4", "--spec-draft-n-min", "0"]
    return llama


class Server:
    def __init__(self, system: str, threads: int, clients: int, target: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(command(system, self.port, threads, clients, target), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"{system} exited: {self.process.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise SystemExit(f"{system} did not start")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def one_request(http: httpx.Client, url: str, prompt: str, mode: str, max_tokens: int, seed: int, llama: bool, stream: bool = True) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "seed": seed, "stream": True,
            "stream_options": {"include_usage": True}, **MODES[mode]}
    if llama:  # llama.cpp's default sampler chain has more stages: plain temperature / top-k only
        body.update(min_p=0.0, top_p=1.0, typical_p=1.0, repeat_penalty=1.0)
    started, first, last, chunks, usage = time.perf_counter(), None, None, 0, None
    if not stream:  # the whole reply at once: no time to first token
        del body["stream"], body["stream_options"]
        response = http.post(url + "/v1/completions", json=body)
        if response.status_code != 200:
            return {"error": f"HTTP {response.status_code}"}
        return {"tokens": response.json()["usage"]["completion_tokens"], "ttft": None, "itl": None}
    with http.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return {"error": f"HTTP {response.status_code}"}
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return {"error": event["error"].get("message", "error")}
            usage = event.get("usage") or usage
            if any(choice.get("text") for choice in event.get("choices", [])):
                now = time.perf_counter()
                first = first or now
                last = now
                chunks += 1
    tokens = usage["completion_tokens"] if usage else chunks
    if first is None:
        return {"tokens": tokens, "ttft": None, "itl": None}
    return {"tokens": tokens, "ttft": first - started, "itl": (last - first) / (tokens - 1) if tokens > 1 else None}


def window(server: Server, clients: int, mode: str, prompts: list[str], max_tokens: int, llama: bool, per_client: int | None = None,
           stream: bool = True) -> dict:
    """`clients` clients at once, each sending `per_client` (default max(1, 4 // clients)) requests in turn."""
    per_client = per_client or max(1, 4 // clients)

    def client(i: int) -> list[dict]:
        with httpx.Client(timeout=600) as http:
            return [one_request(http, server.url, prompts[(i * per_client + j) % len(prompts)], mode, max_tokens, 1000 * i + j, llama, stream)
                    for j in range(per_client)]

    load_before, ray_before = os.getloadavg()[0], ray_cpu_seconds()
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(client, range(clients)) for r in rs]
    seconds = time.perf_counter() - started
    ray_share = (ray_cpu_seconds() - ray_before) / seconds
    ok = [r for r in results if "error" not in r]
    ttft = sorted(r["ttft"] for r in ok if r["ttft"] is not None)
    itl = sorted(r["itl"] for r in ok if r["itl"] is not None)
    return {"clients": clients, "mode": mode, "requests": len(results), "errors": len(results) - len(ok),
            "error_messages": sorted({r["error"] for r in results if "error" in r})[:3],
            "tokens": sum(r["tokens"] for r in ok), "seconds": seconds, "tokens_per_second": sum(r["tokens"] for r in ok) / seconds,
            "ttft_p50": quantile(ttft, 0.5), "ttft_p99": quantile(ttft, 0.99), "itl_p50": quantile(itl, 0.5), "itl_p99": quantile(itl, 0.99),
            "load": [load_before, os.getloadavg()[0]], "ray_cpu": ray_share}


def ray_cpu_seconds() -> float:
    """CPU seconds used so far by Ray's own processes (not the replicas': raylet, GCS, the Serve
    controller, proxy and ingress); 0 where none run."""
    import psutil

    total = 0.0
    for process in psutil.process_iter(["cmdline"]):
        line = " ".join(process.info["cmdline"] or [])
        if any(name in line for name in ("raylet", "gcs_server", "ServeController", "ProxyActor", "specdec-ingress", "dashboard", "log_monitor")):
            try:
                times = process.cpu_times()
                total += times.user + times.system
            except psutil.Error:
                pass
    return total


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(q * len(values)))] if len(values) < 3 else statistics.quantiles(values, n=100, method="inclusive")[int(q * 100) - 1]


def markdown(rows: list[dict]) -> str:
    lines = ["| system | mode | clients | tokens/s | × one-at-a-time | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | errors | load | Ray's CPU |",
             "| --- | --- | ---: | ---: | ---: | --- | --- | ---: | --- | ---: |"]
    serial = {(r["system"], r["mode"], r["clients"]): r["tokens_per_second"] for r in rows if r["system"].endswith("-serial")}
    for r in rows:  # against one-at-a-time specdec on the same backend
        base = serial.get(("specdec-hf-serial" if "-hf" in r["system"] else "specdec-serial", r["mode"], r["clients"]))
        ratio = f"{r['tokens_per_second'] / base:.2f}" if base else ""
        fmt = lambda v, scale=1, digits=2: "–" if v is None else f"{v * scale:.{digits}f}"
        lines.append(f"| {r['system']} | {r['mode']} | {r['clients']} | {r['tokens_per_second']:.0f} | {ratio} | "
                     f"{fmt(r['ttft_p50'])} / {fmt(r['ttft_p99'])} | {fmt(r['itl_p50'], 1000, 1)} / {fmt(r['itl_p99'], 1000, 1)} | "
                     f"{r['errors']} | {r['load'][0]:.2f}→{r['load'][1]:.2f} | {fmt(r.get('ray_cpu'), 100, 0)}% |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", nargs="+", default=["specdec", "specdec-serial", "llama-server", "llama-server-plain", "specdec-hf", "specdec-hf-serial"])
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 4, 16, 64])
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="threads of each specdec process or replica (specdec-wide: twice this)")
    parser.add_argument("--target", default=None, help="a GGUF file (default: the demo pair's target)")
    parser.add_argument("--per-client", type=int, default=None, help="requests each client sends in turn (default: max(1, 4 // clients))")
    parser.add_argument("--whole", action="store_true", help="non-streamed requests (the whole reply at once; no time to first token)")
    parser.add_argument("--rounds", type=int, default=1, help="windows per client count and mode, the systems interleaved")
    parser.add_argument("--output", default=str(HERE / "serve-load"))
    args = parser.parse_args()
    prompts = humaneval_prompts()[:64]
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    rows = []
    for round_ in range(args.rounds):  # rounds take the systems in turn: a slow spell of the machine meets each
        for system in args.systems:
            llama = system.startswith("llama")
            server = None if llama else Server(system, args.threads, max(args.clients), args.target)
            try:
                for clients in args.clients:
                    if llama:  # llama.cpp's server: as many parallel slots as clients
                        server = Server(system, args.threads, clients, args.target)
                    for mode in args.modes:
                        window(server, 1, mode, prompts[-1:], 8, llama)  # warm-up
                        row = {"system": system, "round": round_, "threads": args.threads, "max_tokens": args.max_tokens, "streamed": not args.whole,
                               **window(server, clients, mode, prompts, args.max_tokens, llama, args.per_client, not args.whole)}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                        (output / "results.json").write_text(json.dumps(rows, indent=1))
                    if llama:
                        server.stop()
            finally:
                if server is not None:
                    server.stop()
    (output / "results.md").write_text(markdown(rows) + "\n")
    print(markdown(rows))


if __name__ == "__main__":
    main()
