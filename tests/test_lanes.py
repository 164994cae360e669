"""Long texts are tokenized fairly across API keys (`specdec.server.lanes`): one key's many long
texts cannot hold another key's off, and what waits is bounded (429)."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import string
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

import specdec
import specdec.decoder

from specdec.server.batch import QueueFull
from specdec.server.lanes import FairLanes
from test_server import free_port, wait_until_up


def blocked(log: list, name: str, gate: threading.Event):
    """Work that records when it starts and waits for `gate`."""
    def work():
        log.append(name)
        gate.wait(10)
        return name
    return work


def test_a_key_with_many_texts_holds_one_thread_and_others_start_at_once():
    async def scenario():
        lanes, log, gate = FairLanes(workers=2, limit=64), [], threading.Event()
        hostile = [asyncio.ensure_future(lanes.run("A", blocked(log, f"A{i}", gate))) for i in range(10)]
        await asyncio.sleep(0.1)
        assert log == ["A0"], "one key's texts run one at a time"
        legit = asyncio.ensure_future(lanes.run("B", blocked(log, "B0", threading.Event())))
        await asyncio.sleep(0.1)
        assert log == ["A0", "B0"], "another key's text starts on the free thread, not after A's ten"
        legit.cancel()
        gate.set()
        assert await asyncio.gather(*hostile) == [f"A{i}" for i in range(10)], "each key's texts in arrival order"
    asyncio.run(scenario())


def test_a_server_without_keys_has_one_lane():
    async def scenario():
        lanes = FairLanes(workers=2, limit=8)
        assert await asyncio.gather(lanes.run(None, lambda: 1), lanes.run(None, lambda: 2)) == [1, 2]
    asyncio.run(scenario())


def test_keys_take_turns_on_one_thread():
    async def scenario():
        lanes, log, gate = FairLanes(workers=1, limit=64), [], threading.Event()
        first = asyncio.ensure_future(lanes.run("A", blocked(log, "A0", gate)))
        await asyncio.sleep(0.05)
        rest = [asyncio.ensure_future(lanes.run(key, blocked(log, f"{key}{i}", gate)))
                for key, i in [("A", 1), ("A", 2), ("A", 3), ("B", 0), ("B", 1), ("C", 0)]]
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(first, *rest)
        assert log == ["A0", "B0", "C0", "A1", "B1", "A2", "A3"], "the lanes in turn, not first come first served"
    asyncio.run(scenario())


def test_what_waits_is_bounded_per_key_and_in_all_and_a_cancelled_wait_never_runs():
    async def scenario():
        lanes, log, gate = FairLanes(workers=1, limit=4), [], threading.Event()
        held = [asyncio.ensure_future(lanes.run("A", blocked(log, f"A{i}", gate))) for i in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFull, match="this key already has 2"):
            await lanes.run("A", blocked(log, "A2", gate))
        waiting = [asyncio.ensure_future(lanes.run(key, blocked(log, key, gate))) for key in ("B", "C")]
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFull, match="4 long texts are already waiting"):
            await lanes.run("D", blocked(log, "D", gate))
        waiting[0].cancel()  # B's client left
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(*held, waiting[1])
        assert log == ["A0", "C", "A1"] and not lanes.held, "B never ran; everything was released"
        failing = asyncio.ensure_future(lanes.run("E", lambda: 1 / 0))
        with pytest.raises(ZeroDivisionError):
            await failing
        assert not lanes.held and not lanes.running
    asyncio.run(scenario())


# ---------------------------------------------------------------- the probe's case, on the demo pair


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    """`specdec serve` as the probe ran it: the demo pair on llama.cpp, one thread, keys A and B, a
    process of its own (in this one, the clients' threads would share the server's interpreter)."""
    port = free_port()
    log = tmp_path_factory.mktemp("lanes") / "serve.log"
    process = subprocess.Popen([sys.executable, "-m", "specdec", "serve", "--threads", "1", "--port", str(port),
                                "--api-key", "A", "B"], stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(process, url, 300)
        yield url
    finally:
        process.terminate()
        process.wait(30)


def completion(url: str, key: str, body: bytes) -> float:
    """Seconds a completion takes, end to end (the body JSON-encoded once, before the clock starts)."""
    started = time.perf_counter()
    reply = httpx.post(url + "/v1/completions", content=body, timeout=300,
                       headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    assert reply.status_code == 200, reply.text
    return time.perf_counter() - started


def predicting(prediction: str) -> bytes:
    """A 16-token greedy completion's body, with this prediction."""
    return json.dumps({"model": "target.gguf", "prompt": "def f(x):", "max_tokens": 16, "temperature": 0,
                       "prediction": {"type": "content", "content": prediction}}).encode()


def test_a_keys_long_prediction_is_not_held_hostage_by_another_keys_24(demo_server):
    """The probe: 24 predictions of 900 kB in flight from key A made key B's request with a
    21,000-character prediction wait 6.9 s (0.2-0.4 s alone). Now B's stays within 2.5 times its time
    alone (the median of five each way, in one run; on a 2-core EPYC 0.056 s alone, 0.08-0.09 s beside
    the 24, where it took 1.8-2.0 s before `FairLanes` and 0.12-0.14 s before the lanes yielded the
    cores to the batch: benchmarks/isolation_probe.py --keys). Not twice: beside the suite's other
    worker on the same 2 cores, one run read 0.11 s against 0.05 s alone."""
    url = demo_server
    code = Path(specdec.decoder.__file__).read_text()  # some code, as an edit's prediction would be
    legit = predicting((code * (21_000 // len(code) + 1))[:21_000])
    rng = random.Random(1)
    hostile = predicting("".join(rng.choice(string.ascii_letters + " \n") for _ in range(900_000)))
    completion(url, "B", legit)  # warm
    alone = statistics.median(completion(url, "B", legit) for _ in range(5))
    with ThreadPoolExecutor(24) as pool:
        attack = [pool.submit(completion, url, "A", hostile) for _ in range(24)]
        time.sleep(1.0)  # the 24 are in: one tokenizing, the rest waiting in A's lane
        under_attack = statistics.median(completion(url, "B", legit) for _ in range(5))
        attack_on = not any(f.done() for f in attack[-4:])
        for f in attack:
            f.result()
    assert under_attack <= 2.5 * alone, f"B took {under_attack:.2f} s beside A's 24, {alone:.2f} s alone"
    assert attack_on, "the attack was still on while B was measured"
