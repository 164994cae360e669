"""`specdec serve --replicas` drains on SIGTERM: requests in flight finish within --shutdown-timeout
or end cleanly (a stream with an error event and [DONE]), new ones get 503 meanwhile. A module of
its own: the server runs a Ray instance of its own, which must not meet test_replicas.py's."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from test_server import wait_until_up

pytestmark = pytest.mark.ray
pytest.importorskip("ray.serve")

LONG = {"model": "target.gguf", "prompt": "def f(x):", "max_tokens": 900, "temperature": 1.0, "seed": 0}  # ~5 s on the demo pair, no EOS


def events_of(url: str, body: dict) -> list[str]:
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as reply:
        assert reply.status_code == 200
        return [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]


def test_sigterm_drains_the_replicas_within_the_shutdown_timeout(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url, log = f"http://127.0.0.1:{port}", tmp_path / "serve.log"
    process = subprocess.Popen(["specdec", "serve", "--replicas", "1", "--threads", "1", "--port", str(port), "--shutdown-timeout", "3"],
                               stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    try:
        wait_until_up(process, url, 120)
        short = {"model": "target.gguf", "prompt": "x = [", "max_tokens": 8, "temperature": 0}
        with ThreadPoolExecutor(4) as pool:
            long = [pool.submit(events_of, url, LONG) for _ in range(2)]
            time.sleep(1.5)
            signalled = time.time()
            process.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            assert httpx.get(url + "/health", timeout=5).status_code == 503, "draining: out of rotation"
            assert httpx.post(url + "/v1/completions", json=short, timeout=5).status_code == 503, "draining: no new work"
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
