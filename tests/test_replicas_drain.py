"""`specdec serve --replicas` drains on SIGTERM: requests in flight finish within --shutdown-timeout
or end cleanly (a stream with an error event and [DONE]), new ones get 503 meanwhile. A module of
its own: the server runs a Ray instance of its own, which must not meet test_replicas.py's."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from test_server import free_port, wait_until_up

pytestmark = pytest.mark.ray
pytest.importorskip("ray.serve")

LONG = {"model": "target.gguf", "prompt": "def f(x):", "max_tokens": 900, "temperature": 1.0, "seed": 0}  # ~5 s on the demo pair, no EOS


def events_of(url: str, body: dict, headers: dict) -> list[str]:
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=headers,
                      timeout=120) as reply:
        assert reply.status_code == 200
        return [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]


def serve(port: int, log, replicas: int = 1) -> subprocess.Popen:
    return subprocess.Popen(["specdec", "serve", "--replicas", str(replicas), "--threads", "1", "--port", str(port),
                             "--shutdown-timeout", "3", "--api-key", "K"],
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"))


def test_sigterm_right_after_the_first_200_drains_the_replicas_within_the_shutdown_timeout(tmp_path):
    """The probe's reproducer: streams start as soon as /health first answers 200 (as an
    orchestrator sends traffic when readiness says so), SIGTERM half a second later. With two
    replicas the first answered while the second was still starting, before the command's handlers
    were in place: Ray's then aborted the process and cut every stream."""
    port = free_port()
    url, log = f"http://127.0.0.1:{port}", tmp_path / "serve.log"
    process = serve(port, log, replicas=2)
    key = {"Authorization": "Bearer K"}
    try:
        wait_until_up(process, url, 120)
        short = {"model": "target.gguf", "prompt": "x = [", "max_tokens": 8, "temperature": 0}
        with ThreadPoolExecutor(4) as pool:
            long = [pool.submit(events_of, url, LONG, key) for _ in range(2)]
            time.sleep(0.5)
            signalled = time.time()
            process.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            assert httpx.get(url + "/health", timeout=5).status_code == 503, "draining: out of rotation"
            refused = httpx.post(url + "/v1/completions", json=short, headers=key, timeout=5)
            assert refused.status_code == 503, "draining: no new work"
            streams = [f.result() for f in long]
            ended = time.time() - signalled
        for events in streams:
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "unavailable", events[-2:]
        assert 2.5 < ended < 10, f"the streams ended {ended:.1f} s after SIGTERM, not at the 3 s deadline"
        assert process.wait(60) == 0, log.read_text()
        assert "2 request(s) still running at the deadline were ended" in log.read_text()
    finally:
        if process.poll() is None:
            process.kill()


def test_sigterm_before_the_first_200_stops_cleanly(tmp_path):
    """While the replicas start, the ingress answers 503 (its handlers are not in place yet); a
    SIGTERM then stops whatever was starting, and the command exits 0 with Ray stopped."""
    port = free_port()
    url, log = f"http://127.0.0.1:{port}", tmp_path / "serve.log"
    process = serve(port, log)
    try:
        deadline = time.time() + 120
        while True:  # Ray's proxy is up: the app is being deployed, or the ingress waits to be opened
            try:
                status = httpx.get(url + "/health", timeout=1).status_code
                break
            except httpx.TransportError:
                assert process.poll() is None and time.time() < deadline, log.read_text()
                time.sleep(0.1)
        assert status != 200, "the first answer came before the handlers were in place"
        children = psutil.Process(process.pid).children(recursive=True)
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0, log.read_text()
        assert "stopped before serving" in log.read_text()
        gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, f"Ray's processes outlived the command: {[p.name() for p in alive]}"
    finally:
        if process.poll() is None:
            process.kill()
