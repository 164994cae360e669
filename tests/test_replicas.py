"""specdec serve as Ray Serve replicas, on a local Ray instance (loopback only): greedy answers equal
offline generation, conversations stay on their replica (and so reuse its cache), a replica killed
mid-load loses no request that had not started and comes back, autoscaling goes from 1 to 2 replicas
under load and back. Marked `ray` (about two minutes): `-m "not ray"` skips them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

import specdec
from specdec.config import serve_config
from specdec.errors import SpecDecError
from specdec.server.replicas import REPLICA_HEADER, RESUBMITS_HEADER, Relay
from specdec.server.routing import affinity, prompt_text

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

APP = "specdec"
MODEL = "target.gguf"  # the demo pair's target, as the server names it
PROMPTS = ["def add(a, b):", "import os\n", "class Stack:", "# sort a list\n", "def fib(n):", "for i in range(", "x = [", "while True:"]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def offline():
    return specdec.load(None, threads=1)


def deploy(url: str, *argv: str) -> None:
    """`specdec serve --threads 1 *argv` as the app, up and answering."""
    from specdec.cli import build_parser
    from specdec.cli.arguments import config_options
    from specdec.server.replicas import application

    args = build_parser().parse_args(["serve", "--threads", "1", *argv])
    serve.run(application(serve_config(config_options(args))), name=APP, route_prefix="/")
    deadline = time.time() + 120
    while httpx.get(url + "/health", timeout=10).status_code != 200:
        assert time.time() < deadline, "the app did not come up"
        time.sleep(0.5)


def running_replicas() -> int:
    deployment = serve.status().applications[APP].deployments["specdec-replica"]
    return deployment.replica_states.get("RUNNING", 0)


def wait_for_replicas(count: int, seconds: float) -> float:
    """Seconds until `count` replicas run (the test fails after `seconds`)."""
    started = time.time()
    while running_replicas() != count:
        assert time.time() - started < seconds, f"{running_replicas()} replicas run, not {count}"
        time.sleep(0.25)
    return time.time() - started


def complete(url: str, prompt: str, max_tokens: int = 24, headers: dict | None = None) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
                      headers=headers, timeout=120)


def replica_pids() -> list[int]:
    found = subprocess.run(["pgrep", "-f", f"ServeReplica:{APP}:specdec-replica"], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in found]


def test_affinity_names_a_conversation_by_session_then_user_then_prompt_start():
    headers = [(b"x-session-id", b"abc")]
    chat = json.dumps({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                       "user": "ann"}).encode()
    assert affinity(headers, chat).session.endswith(":abc")
    assert affinity([], chat).session.endswith(":user:ann") and affinity([], chat).text.endswith(":Be brief.Hi")
    assert affinity([], b'{"prompt": "def f():"}') == affinity([], b'{"prompt": "def f():", "max_tokens": 3}')
    assert affinity([], b"not json").text == "" and affinity([], b"[1, 2]").session is None
    alice, mallory = [(b"authorization", b"Bearer a")], [(b"authorization", b"Bearer m")]
    assert affinity(alice, chat).text != affinity(mallory, chat).text, "another key's conversations are not followed"
    assert affinity(alice, chat).session != affinity(alice, chat.replace(b'"user"', b'"cache_salt": "s", "user"')).session
    assert prompt_text({"prompt": [1, 2, 3]}) == "1 2 3"
    unchecked = {"messages": [{"content": [{"text": 5}, "x", {"type": "text", "text": "ok"}]}, {"content": 7}, "junk"]}
    assert prompt_text(unchecked) == "ok", "a body not yet checked gives its text parts, and nothing for the rest"


class Replies:
    """A replica's reply as the ingress sees it: ASGI messages, then (optionally) its death."""

    def __init__(self, messages, dies: bool):
        self.messages, self.dies, self.cancelled = messages, dies, False

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        for message in self.messages:
            yield message
        if self.dies:
            raise ray.exceptions.ActorDiedError()

    def cancel(self):
        self.cancelled = True


def sse(payload: dict) -> dict:
    return {"type": "http.response.body", "body": f"data: {json.dumps(payload)}\n\n".encode(), "more_body": True}


def test_the_relay_holds_back_what_carries_no_text_so_a_chat_stream_can_be_resubmitted():
    import asyncio
    head = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
    role = sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
    token = sse({"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]})

    def relay(messages, dies):
        sent, replies = [], Replies(messages, dies)
        async def send(message):
            sent.append(message)
        relay = Relay(send)
        try:
            asyncio.run(relay.run(replies))
        except ray.exceptions.ActorDiedError:
            pass
        return relay, sent, replies

    held, sent, replies = relay([head, role], dies=True)
    assert not held.sent_body and sent == [] and replies.cancelled, "died before any text: nothing sent, so it can be resubmitted"
    started, sent, _ = relay([head, role, token], dies=True)
    assert started.sent_body and [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    assert sent[1] == role and sent[2] == token and (RESUBMITS_HEADER, b"0") in sent[0]["headers"]


def test_the_serve_config_is_valid_and_its_args_are_specdec_serves_options(monkeypatch):
    import yaml
    from ray.serve.schema import ServeDeploySchema

    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    config = yaml.safe_load((Path(__file__).parent.parent / "deploy" / "serve.yaml").read_text())
    ServeDeploySchema.model_validate(config)
    app = config["applications"][0]
    parsed = serve_config(app["args"])  # what `build` hands the replicas: the CLI's reader of options
    assert (parsed.decoder.runtime.threads, parsed.replicas, parsed.max_batch) == (1, 2, 16)
    replica = next(d for d in app["deployments"] if d["name"] == "specdec-replica")
    assert replica["ray_actor_options"]["num_cpus"] == parsed.decoder.runtime.threads and replica["max_ongoing_requests"] == parsed.max_batch
    assert serve_config({"api_key": ["k1", "k2"]}).api_keys == ("k1", "k2"), "a list of keys: each a tenant"
    given = serve_config({"share_history": True, "allowed_origins": ["http://a", "http://b"], "draft": None, "prefix_cache_tokens": 0})
    assert given.decoder.share_history and given.allowed_origins == ("http://a", "http://b") and given.decoder.prefix_cache == 0
    assert given.decoder.drafter.draft is None and not given.public_metrics, "null is not given; false flags stay off"
    text = serve_config({"threads": "2", "share_history": "true", "public_metrics": "false", "max_batch": "8", "gamma": "3"})  # key=value
    assert (text.decoder.runtime.threads, text.decoder.share_history, text.public_metrics, text.max_batch, text.decoder.gamma) == (2, True, False, 8, 3)
    with pytest.raises(SpecDecError, match="unknown option.*--max-bacth"):
        serve_config({"max_bacth": 8})
    with pytest.raises(SpecDecError, match="--threads: expected a positive integer"):
        serve_config({"threads": "0"})


def test_two_replicas_answer_as_offline_and_keep_conversations_on_their_replica(cluster, offline):
    deploy(cluster, "--replicas", "2")
    assert running_replicas() == 2
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda p: complete(cluster, p), PROMPTS))
    for prompt, reply in zip(PROMPTS, replies):
        assert reply.status_code == 200
        assert reply.json()["choices"][0]["text"] == offline.generate(prompt, max_new_tokens=24, temperature=0).text
    assert len({reply.headers[REPLICA_HEADER.decode()] for reply in replies}) == 2, "both replicas served"

    def converse(index: int, by_session: bool) -> list[httpx.Response]:
        """Three turns; a session header, or only the growing prompt (> 128 characters) names the conversation."""
        text, turns = f"# conversation {index}: " + "a long shared system prompt " * 6, []
        for turn in range(3):
            text += f"\nUser: tell me more ({turn})\nAssistant:"
            reply = complete(cluster, text, 12, headers={"X-Session-Id": f"s{index}"} if by_session else None)
            turns.append(reply)
            text += reply.json()["choices"][0]["text"]
        return turns

    with ThreadPoolExecutor(4) as pool:
        conversations = list(pool.map(lambda i: converse(i, by_session=i % 2 == 0), range(4)))
    for turns in conversations:
        assert len({reply.headers[REPLICA_HEADER.decode()] for reply in turns}) == 1, "a conversation stayed on one replica"
        assert all(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for reply in turns[1:]), "later turns reused the cache"


def test_a_replica_killed_mid_load_loses_no_request_that_had_not_started(cluster, offline):
    """Every try asserts that nothing is lost. Which replica a request lands on is Ray's choice, so a kill may
    find its replica idle or its requests done (on a busy machine): up to three tries, until one kill meets
    requests that had not finished and they are resubmitted."""
    deploy(cluster, "--replicas", "2")
    for _ in range(3):
        resubmitted = kill_mid_load(cluster, offline)
        if resubmitted:
            break
        wait_for_replicas(2, 120)
    assert resubmitted > 0, "in three tries no kill came while the victim held requests that were then resubmitted"


def kill_mid_load(cluster: str, offline) -> int:
    """Kill a replica once requests flow; every reply must still be whole and right, every stream end cleanly
    (cut with an error event after a prefix of the right text, or whole). Returns how many replies were resubmitted."""
    prompts = PROMPTS * 2
    flowing = threading.Event()  # set at any stream's first text: the replicas are decoding
    with ThreadPoolExecutor(len(prompts) + 4) as pool:
        whole = [pool.submit(complete, cluster, p, 160) for p in prompts]
        streams = [pool.submit(stream, cluster, p, 160, flowing) for p in PROMPTS[:4]]
        assert flowing.wait(120), "no stream began"
        victim = replica_pids()[0]
        os.kill(victim, signal.SIGKILL)
        killed_at = time.time()
        replies = [f.result() for f in whole]
        streamed = [f.result() for f in streams]
    for prompt, reply in zip(prompts, replies):
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == offline.generate(prompt, max_new_tokens=160, temperature=0).text
    resubmitted = sum(int(reply.headers[RESUBMITS_HEADER.decode()]) > 0 for reply in replies)
    cut = []
    for prompt, (text, events) in zip(PROMPTS, streamed):
        assert events[-1] == "[DONE]", "every stream ends, none hangs"
        errors = [e for e in events[:-1] if "error" in json.loads(e)]
        cut.append(bool(errors))
        if errors:  # cut midway: a clean error event, after a prefix of the right text
            assert json.loads(errors[0])["error"]["code"] == "unavailable"
        assert offline.generate(prompt, max_new_tokens=160, temperature=0).text.startswith(text)
        assert errors or text == offline.generate(prompt, max_new_tokens=160, temperature=0).text
    recovery = wait_for_replicas(2, 120)
    assert victim not in replica_pids()
    print(f"{resubmitted} of {len(replies)} requests resubmitted, {sum(cut)} of {len(streamed)} streams cut; "
          f"replica replaced {time.time() - killed_at:.1f} s after the kill ({recovery:.1f} s after the last reply)")
    return resubmitted


def test_the_ingress_answers_malformed_bodies_as_one_process_does(cluster):
    deploy(cluster, "--replicas", "1")
    for body in ("[" * 5000 + "]" * 5000, "{" * 100_000, '{"prompt": ' * 3000):
        reply = httpx.post(cluster + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=60)
        assert reply.status_code == 400 and "error" in reply.json()
    bare = socket.create_connection(("127.0.0.1", int(cluster.rsplit(":", 1)[1])), timeout=10)
    with bare:
        bare.sendall(b"GET /health HTTP/1.0\r\nConnection: close\r\n\r\n")
        assert bare.recv(64).split()[1] == b"200", "HTTP/1.0 needs no Host"


def stream(url: str, prompt: str, max_tokens: int, began: threading.Event | None = None) -> tuple[str, list[str]]:
    """A streamed completion's text and its raw events (`began` set at its first text)."""
    events, text = [], ""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if line[6:] != "[DONE]" and "choices" in json.loads(line[6:]):
                    text += json.loads(line[6:])["choices"][0]["text"]
                    if began is not None and text:
                        began.set()
    return text, events


def test_autoscaling_goes_from_one_replica_to_two_under_load_and_back(cluster):
    deploy(cluster, "--replicas", "1", "--max-replicas", "2", "--max-batch", "4")
    assert running_replicas() == 1
    deadline, scaled_up = time.time() + 90, None
    with ThreadPoolExecutor(8) as pool:
        while scaled_up is None:
            assert time.time() < deadline, "no second replica under load"
            batch = [pool.submit(complete, cluster, p, 96) for p in PROMPTS]
            while not all(f.done() for f in batch):
                if running_replicas() == 2:
                    scaled_up = time.time()
                time.sleep(0.25)
            assert all(f.result().status_code == 200 for f in batch)
    down = wait_for_replicas(1, 120)
    print(f"scaled to 2 replicas under load; back to 1 {down:.1f} s after the load ended")
