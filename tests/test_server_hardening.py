"""`specdec serve` under load and abuse: batching, cancellation mid-batch, bounded shutdown,
deadlines for slow clients, a connection cap, authentication, CORS, Host checks, protocol details,
and the OpenAI fields it honours (logprobs, echo, token-id prompts, content parts) or refuses."""

from __future__ import annotations

import json
import math
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
import torch

import specdec

from specdec.server import create_app
from specdec.server.http import HeaderDeadline
from test_server import CHAT_TEMPLATE, MODEL, LiveServer, SlowDrafter, make_decoder, metric, sse_events, wait_until_up


@pytest.fixture(scope="module")
def decoder(model_dirs):
    return make_decoder(model_dirs)


@pytest.fixture(scope="module")
def offline(model_dirs):
    return make_decoder(model_dirs)


@pytest.fixture(scope="module")
def server(decoder):
    live = LiveServer(create_app(decoder, MODEL, depth=None))
    yield live
    live.stop()


def stream(url: str, body: dict, path: str = "/v1/completions", **headers) -> list:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, headers=headers, timeout=60) as response:
        assert response.status_code == 200, response.read()
        return sse_events(response)


def streamed_text(events: list) -> str:
    return "".join(c["text"] for e in events if isinstance(e, dict) and "choices" in e for c in e["choices"])


def until_running(live, rows: int = 1, waiting: int = 0, timeout: float = 30) -> None:
    """Wait until the server runs `rows` generations with `waiting` queued: what a test that signals or drains
    next assumes (a fixed sleep lost a request still on its way to the drain's 503 on a loaded machine)."""
    deadline = time.time() + timeout
    while (metric(live, "specdec_batch_size"), metric(live, "specdec_queue_depth")) != (rows, waiting):
        assert time.time() < deadline, f"the server never ran {rows} generations with {waiting} waiting"
        time.sleep(0.02)


def health_becomes(live, status: int, timeout: float = 30) -> bool:
    """Whether /health answers `status` within the timeout, asked again every 50 ms: a held connection counts
    once the server has accepted it, which a fixed sleep assumed (on a loaded machine it may not have)."""
    deadline = time.time() + timeout
    while httpx.get(live.url + "/health", timeout=5).status_code != status:
        if time.time() > deadline:
            return False
        time.sleep(0.05)
    return True


# ---------------------------------------------------------------- batching and cancellation


def test_requests_share_steps_and_a_cancelled_one_leaves_the_others_intact(model_dirs, offline):
    """Four slow streams run together (batch rows > 1 per step); one client hangs up mid-batch: its
    row leaves at the next step, the other three still equal offline generation."""
    decoder = make_decoder(model_dirs)
    decoder.drafter = SlowDrafter(decoder.drafter)
    live = LiveServer(create_app(decoder, MODEL, depth=None))
    bodies = [{"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0.9, "seed": i}
              for i, prompt in enumerate(["hi ej", "ab", "ej ej hi", "b a"])]

    def hang_up_early():
        with httpx.stream("POST", live.url + "/v1/completions", json={**bodies[0], "stream": True}, timeout=60) as response:
            for line in response.iter_lines():
                if '"text"' in line:
                    return  # one delta, then leave

    try:
        with ThreadPoolExecutor(4) as pool:
            leaver = pool.submit(hang_up_early)
            others = [pool.submit(stream, live.url, body) for body in bodies[1:]]
            leaver.result()
            texts = [streamed_text(f.result()) for f in others]
        for body, text in zip(bodies[1:], texts):
            assert text == offline.generate(body["prompt"], max_new_tokens=24, temperature=0.9, seed=body["seed"]).text
        assert metric(live, "specdec_cancelled_total") == 1
        steps, rows = metric(live, "specdec_batch_rows_count"), metric(live, "specdec_batch_rows_sum")
        assert rows / steps > 1.5, "the requests did not share steps"
    finally:
        live.stop()


def test_shutdown_ends_waiting_and_running_streams_in_bounded_time(model_dirs):
    """One running (max_batch 1), two waiting: the waiting ones get an error event and [DONE] at
    once, the running one gets `timeout` seconds, then an error event and [DONE]; new requests 503."""
    decoder = make_decoder(model_dirs)
    decoder.drafter = SlowDrafter(decoder.drafter)  # 60 tokens take >= 1 s
    app = create_app(decoder, MODEL, depth=None, max_batch=1)
    live = LiveServer(app)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 60, "temperature": 0}
    try:
        with ThreadPoolExecutor(3) as pool:
            streams = [pool.submit(stream, live.url, body) for _ in range(3)]
            until_running(live, 1, waiting=2)  # the first runs for >= 1 s
            started = time.time()
            app.state.service.drain(timeout=0.3)
            ended = time.time() - started
            events = [f.result() for f in streams]
        assert ended < 2.0
        for e in events:
            assert e[-1] == "[DONE]"
        codes = sorted(e[-2]["error"]["code"] for e in events)
        assert codes == ["unavailable"] * 3, "every stream was ended by the shutdown, with an error event"
        refused = httpx.post(live.url + "/v1/completions", json=body, timeout=10)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    finally:
        live.stop()


def test_sigterm_stops_specdec_serve_within_its_timeout(model_dirs):
    """The real command: queued streams end with an error event and [DONE], the process exits
    within --shutdown-timeout plus a little."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "specdec", "serve", "--target", model_dirs["llama"], "--draft", model_dirs["llama-near"],
               "--port", str(port), "--model-name", MODEL, "--device", "cpu", "--shutdown-timeout", "1", "--max-batch", "1"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(process, url)
        # far more work than the 1 s after the signal, however fast the machine (12 streams of 40 tokens all
        # finished in time once): most wait in the queue (it holds 16)
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 60, "temperature": 1.0}
        with ThreadPoolExecutor(16) as pool:
            streams = [pool.submit(stream, url, {**body, "seed": i}) for i in range(16)]
            # signal once every stream is admitted (a fixed wait lost one to "shutting down" on a busy machine)
            admitted = SimpleNamespace(url=url)
            deadline = time.time() + 30
            while metric(admitted, 'specdec_requests_total{endpoint="/v1/completions",status="200"}') < 16:
                assert time.time() < deadline, "the 16 streams were not admitted"
                time.sleep(0.05)
            process.send_signal(signal.SIGTERM)
            signalled = time.time()
            assert process.wait(timeout=10) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down
            exited = time.time() - signalled
            events = [f.result() for f in streams]
        assert exited < 5
        assert all(e[-1] == "[DONE]" for e in events)
        assert any("error" in e[-2] for e in events), "the queued streams were ended with an error event"
    finally:
        if process.poll() is None:
            process.kill()
        process.stderr.close()


# ---------------------------------------------------------------- slow clients and connections


def test_a_half_sent_request_head_is_closed(decoder, monkeypatch):
    monkeypatch.setattr(HeaderDeadline, "header_timeout", 0.5)
    live = LiveServer(create_app(decoder, MODEL, depth=None))
    try:
        with socket.create_connection(("127.0.0.1", live.port)) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
            client.settimeout(5)
            started = time.time()
            assert client.recv(1024) == b"", "the server closes the connection"
            assert time.time() - started < 2
    finally:
        live.stop()


def test_a_trickled_body_gets_408(decoder):
    live = LiveServer(create_app(decoder, MODEL, depth=None, body_timeout=0.5))
    try:
        with socket.create_connection(("127.0.0.1", live.port)) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 100\r\n\r\n{\"model\":")
            client.settimeout(5)
            reply, started = b"", time.time()
            while chunk := client.recv(4096):  # the rest of a late body may still arrive: the server closes the connection
                reply += chunk
            closed = time.time() - started
        assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive" in reply and b"connection: close" in reply.lower()
        assert closed < 2, "closed with the reply, not after the keep-alive timeout"
    finally:
        live.stop()


def test_connections_beyond_the_cap_get_503(decoder):
    live = LiveServer(create_app(decoder, MODEL, depth=None), max_connections=2)
    held = [socket.create_connection(("127.0.0.1", live.port)) for _ in range(2)]
    try:
        assert health_becomes(live, 503), "a third connection was served beside the two held"
        for sock in held:
            sock.close()
        assert health_becomes(live, 200), "the cap held after the two connections closed"
    finally:
        live.stop()


# ---------------------------------------------------------------- access


def test_api_key_cors_and_host_checks(decoder):
    live = LiveServer(create_app(decoder, MODEL, depth=None, api_keys=["s3cret"], allowed_origins=["http://app.example"],
                                 allowed_hosts=["127.0.0.1", "localhost"]))
    body = {"model": MODEL, "prompt": "ab", "max_tokens": 2}
    try:
        missing = httpx.post(live.url + "/v1/completions", json=body, timeout=10)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
        assert httpx.post(live.url + "/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
        assert httpx.post(live.url + "/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"}, timeout=30).status_code == 200
        assert httpx.get(live.url + "/health").status_code == 200  # health needs no key
        preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
        allowed = httpx.options(live.url + "/v1/completions", headers=preflight)
        assert allowed.headers.get("access-control-allow-origin") == "http://app.example"
        other = httpx.options(live.url + "/v1/completions", headers={**preflight, "Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers
        rebound = httpx.get(live.url + "/health", headers={"Host": "evil.example"})
        assert rebound.status_code == 400 and "Host" in rebound.json()["error"]["message"]
        for host in (f"evil.example@127.0.0.1:{live.port}", "127.0.0.1#evil", "", "127.0.0.1/x", f"localhost:{live.port}?"):
            assert raw_status(live.port, f"GET /health HTTP/1.1\r\nHost: {host}\r\n") == 400, host
        for host in (f"127.0.0.1:{live.port}", "LOCALHOST", "localhost:80"):
            assert raw_status(live.port, f"GET /health HTTP/1.1\r\nHost: {host}\r\n") == 200, host
        assert raw_status(live.port, "GET /health HTTP/1.0\r\n") == 200, "HTTP/1.0 needs no Host"
        assert raw_status(live.port, f"GET http://evil.example/v1/models HTTP/1.1\r\nHost: 127.0.0.1:{live.port}\r\n") == 404
        assert httpx.get(live.url + "/metrics").status_code == 401, "/metrics is behind a key"
        tenant = httpx.get(live.url + "/metrics", headers={"Authorization": "Bearer s3cret"})
        assert tenant.status_code == 403 and "--metrics-key" in tenant.json()["error"]["message"], "not a tenant's key"
    finally:
        live.stop()


@pytest.mark.parametrize("keys, options, opened_by", [
    (["a", "b"], {"metrics_key": "op"}, "op"),  # the operator's key, and no tenant's
    (["a", "b"], {}, None),  # keys and no metrics key: no one
    (["a", "b"], {"public_metrics": True}, ""),  # anyone
    ([], {}, ""),  # one tenant: nothing to hide from anyone
    ([], {"metrics_key": "op"}, "op"),
])
def test_server_wide_metrics_are_the_operators(decoder, keys, options, opened_by):
    live = LiveServer(create_app(decoder, MODEL, depth=None, api_keys=keys, **options))
    try:
        for given in ("", "a", "b", "op", "wrong"):
            reply = httpx.get(live.url + "/metrics", headers={"Authorization": f"Bearer {given}"} if given else {})
            if opened_by == "" or given == opened_by:  # "": open to anyone
                assert reply.status_code == 200 and "specdec_generated_tokens_total" in reply.text, (given, reply.text)
            else:
                assert reply.status_code == (403 if given in keys else 401), (given, reply.status_code)
                assert reply.json()["error"]["message"].startswith("/metrics counts every tenant's requests")
        if options.get("metrics_key") and keys:  # the operator's key opens nothing else
            assert httpx.get(live.url + "/v1/models", headers={"Authorization": "Bearer op"}).status_code == 401
    finally:
        live.stop()


def raw_status(port: int, head: str) -> int:
    """The status of a hand-written request (httpx would fix its Host header)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        connection.sendall((head + "Connection: close\r\n\r\n").encode())
        reply = b""
        while b"\r\n" not in reply:
            chunk = connection.recv(4096)
            if not chunk:
                break
            reply += chunk
    return int(reply.split()[1])


# ---------------------------------------------------------------- protocol details


def test_protocol_details(server):
    wrong_method = httpx.get(server.url + "/v1/completions")
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    assert httpx.head(server.url + "/health").status_code == 200
    schema = httpx.get(server.url + "/openapi.json").json()
    responses = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert "422" not in json.dumps(schema["paths"]) and {"400", "411", "413", "429"} <= set(responses)
    chat = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "tool", "content": "x"}]})
    assert chat.status_code == 400 and chat.json()["error"]["param"].startswith("messages")
    text = httpx.get(server.url + "/metrics").text
    for name in ("specdec_time_to_first_token_seconds_bucket", "specdec_inter_token_latency_seconds_bucket",
                 "specdec_request_duration_seconds_bucket", "specdec_batch_size", "specdec_batch_rows_bucket"):
        assert name in text


REFUSED = [
    ("best_of", {"best_of": 2}), ("suffix", {"suffix": "end"}), ("presence_penalty", {"presence_penalty": 2.5}),
    ("frequency_penalty", {"frequency_penalty": -3}), ("logit_bias", {"logit_bias": {"3": 500}}),
    ("logit_bias", {"logit_bias": {"x": 5}}), ("min_p", {"min_p": 1.5}), ("repetition_penalty", {"repetition_penalty": 0}),
    ("stop_token_ids", {"stop_token_ids": [10**6]}),
    ("echo", {"echo": True, "logprobs": 1}), ("prompt", {"prompt": ["a", "b"]}),
    # structured outputs are honoured (tests/test_constraints.py); this tiny model has no end token to finish them
    ("response_format", {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}}),
    ("guided_regex", {"guided_regex": "a+"}),
]


@pytest.mark.parametrize("param,fields", REFUSED, ids=[r[0] for r in REFUSED])
def test_fields_that_are_not_honoured_are_refused(server, param, fields):
    response = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "ab", **fields}, timeout=10)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_chat_refuses_tools_its_template_cannot_show_and_a_constraint_the_model_cannot_end(server):
    tool = {"type": "function", "function": {"name": "f"}}
    for fields, param in (({"tools": [tool]}, "tools"), ({"response_format": {"type": "json_object"}}, "response_format")):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "a"}], **fields}
        response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=10)
        assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_token_id_prompts_echo_content_parts_and_developer(server, offline):
    ids = offline.prompt_ids("hi ej")
    by_ids = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 6, "temperature": 0}, timeout=30).json()
    assert by_ids["choices"][0]["text"] == offline.generate(ids, max_new_tokens=6, temperature=0).text
    echoed = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": ["hi ej"], "max_tokens": 6, "temperature": 0, "echo": True}, timeout=30).json()
    assert echoed["choices"][0]["text"] == "hi ej" + by_ids["choices"][0]["text"]
    assert streamed_text(stream(server.url, {"model": MODEL, "prompt": "hi ej", "max_tokens": 6, "temperature": 0, "echo": True})) == echoed["choices"][0]["text"]
    parts = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "ej"}]}]
    reply = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": parts, "max_tokens": 6, "temperature": 0}, timeout=30).json()
    prompt = offline.tokenizer.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi ej"}],
                                                   add_generation_prompt=True, tokenize=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    assert reply["choices"][0]["message"]["content"] == offline.generate(list(prompt), max_new_tokens=6, temperature=0).text


def test_logprobs_are_the_targets_own(server, offline):
    """Each token's logprob is the target's log-softmax at that position, computed without a cache;
    streamed chunks carry the same values; chat reports them in its own shape."""
    body = {"model": MODEL, "prompt": "hi ej", "max_tokens": 8, "temperature": 0.8, "seed": 3, "logprobs": 2}
    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()
    logprobs = reply["choices"][0]["logprobs"]
    tokens = offline.generate("hi ej", max_new_tokens=8, temperature=0.8, seed=3).tokens
    prompt = offline.prompt_ids("hi ej")
    with torch.inference_mode():
        rows = offline.target.model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1, : offline.target.vocab_size]
    want = torch.log_softmax(rows.double(), dim=-1)
    assert len(logprobs["token_logprobs"]) == len(tokens)
    for i, token in enumerate(tokens):
        assert math.isclose(logprobs["token_logprobs"][i], float(want[i, token]), abs_tol=1e-4)
        assert len(logprobs["top_logprobs"][i]) <= 2 and max(logprobs["top_logprobs"][i].values()) == pytest.approx(float(want[i].max()), abs=1e-4)
    streamed = [lp for e in stream(server.url, body) if isinstance(e, dict) and e.get("choices")
                for c in e["choices"] if c.get("logprobs") for lp in c["logprobs"]["token_logprobs"]]
    assert streamed == pytest.approx(logprobs["token_logprobs"])
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 1}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"]
    assert all(entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"]) for entry in content)  # greedy: the top token


def test_a_full_queue_is_refused_before_tokenizing(model_dirs):
    decoder = make_decoder(model_dirs)
    decoder.drafter = SlowDrafter(decoder.drafter)
    encoded = []
    prompt_ids = decoder.prompt_ids
    decoder.prompt_ids = lambda prompt: encoded.append(prompt) or prompt_ids(prompt)
    live = LiveServer(create_app(decoder, MODEL, depth=None, max_queue=1, max_batch=1))
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 60, "temperature": 0}  # >= 1 s each
    try:
        with ThreadPoolExecutor(2) as pool:
            busy = []
            for want in ({"batch_size": 1, "queue_depth": 0}, {"batch_size": 1, "queue_depth": 1}):  # one runs, then one waits
                busy.append(pool.submit(httpx.post, live.url + "/v1/completions", json=body, timeout=60))
                deadline = time.time() + 5
                while {k: v for k, v in httpx.get(live.url + "/health").json().items() if k != "status"} != want:
                    assert time.time() < deadline
                    time.sleep(0.01)
            refused = httpx.post(live.url + "/v1/completions", json={**body, "prompt": "never tokenized"}, timeout=10)
            assert [f.result().status_code for f in busy] == [200, 200]
        assert refused.status_code == 429 and "never tokenized" not in encoded
    finally:
        live.stop()


def test_chat_template_file_for_a_model_without_one(model_dirs, tmp_path):
    """`specdec serve --chat-template FILE`: chat works on a model that has no template; a bad file is a clear error."""
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    base = [sys.executable, "-m", "specdec", "serve", "--target", model_dirs["llama"], "--device", "cpu", "--model-name", MODEL]
    failed = subprocess.run(base + ["--chat-template", str(bad), "--port", "1"], capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1 and "not a valid Jinja template" in failed.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(base + ["--chat-template", str(template), "--port", str(port)], stderr=subprocess.DEVNULL)
    try:
        wait_until_up(process, f"http://127.0.0.1:{port}")
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30,
                           json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] is not None
    finally:
        process.terminate()
        process.wait(10)


def test_streamed_logprobs_wait_for_text_a_stop_string_may_cut():
    """Finding (review): logprobs went out for every committed token, also for one whose text was
    held back and then cut by a stop string. Only tokens whose text has gone out are settled."""
    from specdec.api import TextAssembler
    from specdec.engine import StepResult, TokenLogprob

    class Pieces:  # token i is the text PIECES[i]
        PIECES = ["Hi", "\n", "there"]

        def decode(self, ids, skip_special_tokens=True):
            return "".join(self.PIECES[i] for i in ids)

    text = TextAssembler(Pieces(), [0], stop=["\n\n"])
    step = lambda tokens: StepResult(tokens, logprobs=[TokenLogprob(t, -1.0, []) for t in tokens])
    assert text.add(step([0, 1])) == "Hi" and text.settled() == 1  # "\n" may begin the stop: held back, with its logprob
    assert text.add(step([1])) == "" and text.finish_reason == "stop"
    assert text.tokens == [0] and len(text.logprobs) == 1 and text.settled() == 1


# ---------------------------------------------------------------- one request never stalls the others


def post_and_hang_up(url: str, body: dict, after: float) -> None:
    """A raw client that sends a non-streamed request and closes its socket `after` seconds later."""
    payload = json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        time.sleep(after)


def test_a_non_streamed_request_is_cancelled_when_its_client_leaves(model_dirs):
    """Finding (outside probe): a non-streamed request went on generating after its client had gone,
    because `Request.is_disconnected` never fired behind the middleware. Now it stops at the next
    step, is counted as cancelled, and its slot is free for the next request."""
    decoder = make_decoder(model_dirs)
    decoder.drafter = SlowDrafter(decoder.drafter)  # 55 tokens take >= 0.7 s
    live = LiveServer(create_app(decoder, MODEL, depth=None))
    try:
        post_and_hang_up(live.url, {"model": MODEL, "prompt": "hi ej", "max_tokens": 55, "temperature": 1}, after=0.3)
        hung_up = time.time()
        while metric(live, "specdec_cancelled_total") < 1:
            assert time.time() < hung_up + 5, "the generation was not cancelled"
            time.sleep(0.02)
        assert metric(live, "specdec_generated_tokens_total") == 0  # it never finished: cancelled before its end
        assert httpx.get(live.url + "/health").json()["batch_size"] == 0
        assert metric(live, 'specdec_requests_total{endpoint="/v1/completions",status="499"}') == 1
    finally:
        live.stop()


def test_a_storm_of_abandoned_requests_drains_at_once(model_dirs):
    """Twelve non-streamed requests whose clients all leave: every one is cancelled, none runs to its end."""
    decoder = make_decoder(model_dirs)
    decoder.drafter = SlowDrafter(decoder.drafter)
    live = LiveServer(create_app(decoder, MODEL, depth=None, max_batch=4))
    body = {"model": MODEL, "prompt": "ab", "max_tokens": 55, "temperature": 1}
    try:
        with ThreadPoolExecutor(12) as pool:
            list(pool.map(lambda i: post_and_hang_up(live.url, {**body, "seed": i}, after=0.3), range(12)))
        deadline = time.time() + 3  # twelve whole generations, four at a time, would take >= 2 s
        while metric(live, "specdec_cancelled_total") < 12:
            assert time.time() < deadline, f"{metric(live, 'specdec_cancelled_total')} of 12 cancelled"
            time.sleep(0.05)
        assert metric(live, "specdec_generated_tokens_total") == 0
    finally:
        live.stop()


def test_one_heavy_request_beside_light_ones(server, offline):
    """Finding (outside probe): four stop strings of 200,000 characters took 15 s for 8 tokens, on
    the batch thread every generation shares (each step tried every prefix of every stop), and the
    requests beside it waited as long. Stop strings now cost what the text costs: the heavy
    request stops where offline generation does and the light ones are not held up (a generous
    bound: the old code needed over 10 s here; these take well under one alone)."""
    huge = ["q" * 200_000, "m" * 199_999 + "a", "b" * 200_000, "z" * 200_000]  # ~800 kB, under the 1 MiB body limit
    heavy = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 40, "temperature": 0, "stop": huge}
    light = {"model": MODEL, "prompt": "hi ej", "max_tokens": 8, "temperature": 0}
    with ThreadPoolExecutor(4) as pool:
        heavy_reply = pool.submit(httpx.post, server.url + "/v1/completions", json=heavy, timeout=60)
        time.sleep(0.1)
        started = time.time()
        lights = [pool.submit(httpx.post, server.url + "/v1/completions", json=light, timeout=60) for _ in range(3)]
        assert all(f.result().status_code == 200 for f in lights)
        light_seconds = time.time() - started
        reply = heavy_reply.result()
    assert light_seconds < 5
    assert reply.status_code == 200
    # none of the stops can occur in 40 tokens of this 15-character vocabulary: the whole text
    assert reply.json()["choices"][0]["text"] == offline.generate("def f(x):", max_new_tokens=40, temperature=0).text


def took_turns(turns: list) -> bool:
    """Once both prompts have had a chunk, neither gets two in a row while the other has some left."""
    left, seen = Counter(turns), set()
    for current, following in zip(turns, turns[1:]):
        left[current] -= 1
        seen.add(current)
        other = next(iter(set(turns) - {current}))
        if following == current and other in seen and left[other] > 0:
            return False
    return True


def test_long_prompts_are_prefilled_in_turns_between_the_others_steps(model_dirs, offline, monkeypatch):
    """Joining prompts go in one PREFILL_CHUNK a round, taking turns, so a request already running
    is stepped between the chunks and no prompt waits for another's whole prefill; the chunks are
    those of a lone generation (the same cut everywhere), so the text is offline generation's."""
    from specdec import engine as engine_module
    monkeypatch.setattr(engine_module, "PREFILL_CHUNK", 8)
    decoder = make_decoder(model_dirs)
    decoder.drafter = SlowDrafter(decoder.drafter)
    app = create_app(decoder, MODEL, depth=None)
    engine, calls = app.state.service.batcher.engine, []
    prefill, step = engine.prefill, engine.step
    monkeypatch.setattr(engine, "prefill", lambda state: calls.append(("prefill", len(state.prompt))) or prefill(state))
    monkeypatch.setattr(engine, "step", lambda states, cap=None: calls.append(("step", len(states))) or step(states, cap))
    live = LiveServer(app)
    prompts = ["ab cd ef gh ij kl ab cd ef gh ij kl ab cd", "hi ej hi ej hi ej hi ej hi ej hi ej hi ej hi"]  # 41 and 44 tokens
    bodies = [{"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0.8, "seed": 5} for prompt in prompts]
    try:
        with ThreadPoolExecutor(3) as pool:
            running = pool.submit(stream, live.url, {"model": MODEL, "prompt": "hi", "max_tokens": 60, "temperature": 0})
            until_running(live)
            joining = [pool.submit(httpx.post, live.url + "/v1/completions", json=body, timeout=60) for body in bodies]
            texts = [f.result().json()["choices"][0]["text"] for f in joining]
            running.result()
    finally:
        live.stop()
    lengths = [len(offline.prompt_ids(prompt)) for prompt in prompts]
    chunks = [(i, call[1]) for i, call in enumerate(calls) if call[0] == "prefill" and call[1] in lengths]
    assert sorted(n for _, n in chunks) == [lengths[0]] * 5 + [lengths[1]] * 6  # 40 and 43 tokens fed, 8 at a time
    assert all(any(call[0] == "step" for call in calls[a + 1 : b]) for (a, _), (b, _) in zip(chunks, chunks[1:])), \
        "the running request was stepped between chunks"
    assert took_turns([n for _, n in chunks]), "the two prompts took turns"
    for body, text in zip(bodies, texts):
        assert text == offline.generate(body["prompt"], max_new_tokens=8, temperature=0.8, seed=5).text


def test_a_request_cancelled_while_its_prompt_is_prefilled_frees_its_slots(model_dirs, monkeypatch):
    from specdec import engine as engine_module
    monkeypatch.setattr(engine_module, "PREFILL_CHUNK", 1)  # 40 rounds of prefill, each beside a slow step
    decoder = make_decoder(model_dirs)
    decoder.drafter = SlowDrafter(decoder.drafter)
    live = LiveServer(create_app(decoder, MODEL, depth=None))
    try:
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(stream, live.url, {"model": MODEL, "prompt": "hi", "max_tokens": 60, "temperature": 0})
            until_running(live)
            post_and_hang_up(live.url, {"model": MODEL, "prompt": "ab cd ef gh ij kl ab cd ef gh ij kl ab cd", "max_tokens": 4}, after=0.3)
            deadline = time.time() + 5
            while metric(live, "specdec_cancelled_total") < 1:
                assert time.time() < deadline, "the prefilling request was not cancelled"
                time.sleep(0.02)
            assert httpx.get(live.url + "/health").json()["batch_size"] == 1  # only the running stream is left
            running.result()
        assert metric(live, "specdec_generated_tokens_total") == 60
    finally:
        live.stop()


# ---------------------------------------------------------------- rough edges of the outside probe


def test_sigterm_answers_new_requests_with_503_while_draining(model_dirs):
    """After SIGTERM the server keeps accepting connections while running generations finish:
    a new request gets 503 with Retry-After, /health 503 (out of rotation), never a refused connection."""
    decoder = make_decoder(model_dirs)
    decoder.drafter = SlowDrafter(decoder.drafter)
    live = LiveServer(create_app(decoder, MODEL, depth=None), shutdown_timeout=3.0)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 40, "temperature": 0}
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(stream, live.url, body)
        until_running(live)
        live.server.handle_exit(signal.SIGTERM, None)
        time.sleep(0.1)
        refused = httpx.post(live.url + "/v1/completions", json=body, timeout=10)
        health = httpx.get(live.url + "/health", timeout=10)
        events = running.result()
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert health.status_code == 503 and health.json()["status"] == "shutting down"
    assert events[-1] == "[DONE]" and "error" not in events[-2], "the running stream was let finish"
    live.thread.join(10)
    assert not live.thread.is_alive(), "the server exited once drained"


def test_a_second_signal_ends_running_generations_at_once(model_dirs):
    decoder = make_decoder(model_dirs)
    decoder.drafter = SlowDrafter(decoder.drafter)
    live = LiveServer(create_app(decoder, MODEL, depth=None), shutdown_timeout=30.0)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(stream, live.url, {"model": MODEL, "prompt": "hi", "max_tokens": 60, "temperature": 0})
        until_running(live)
        live.server.handle_exit(signal.SIGTERM, None)
        time.sleep(0.1)
        signalled = time.time()
        live.server.handle_exit(signal.SIGTERM, None)
        events = running.result()
        live.thread.join(10)
        exited = time.time() - signalled
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "unavailable"
    assert not live.thread.is_alive() and exited < 5, "not the 30 s the first signal would have waited"


def test_openapi_documents_streams_and_strict_types(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        content = schema["paths"][path]["post"]["responses"]["200"]["content"]
        assert {"application/json", "text/event-stream"} <= set(content)
    top_k = schema["components"]["schemas"]["CompletionRequest"]["properties"]["top_k"]
    assert "2147483647" in json.dumps(top_k)
    malformed = httpx.post(server.url + "/v1/completions", content=b'{"model": "tiny",, }', headers={"content-type": "application/json"})
    error = malformed.json()["error"]
    assert malformed.status_code == 400 and error["param"] is None and "not valid JSON" in error["message"]


def test_metrics_show_acceptance_per_source(model_dirs):
    """The default drafter's tokens, by source: how many verification reached and how many it accepted."""
    decoder = specdec.load(model_dirs["llama"], draft=model_dirs["llama-near"], device="cpu")  # the default: auto
    live = LiveServer(create_app(decoder, MODEL))
    try:
        for prompt in ("ab ab ab ab ab", "hi ej hi ej"):
            reply = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 30, "temperature": 0}, timeout=60)
            assert reply.status_code == 200
        tried = {source: metric(live, f'specdec_draft_tokens_total{{source="{source}"}}') for source in ("model", "lookup")}
        accepted = {source: metric(live, f'specdec_accepted_draft_tokens_total{{source="{source}"}}') for source in ("model", "lookup")}
    finally:
        live.stop()
    assert tried["model"] > 0 and all(0 <= accepted[s] <= tried[s] for s in tried)
    assert sum(accepted.values()) > 0


def test_new_requests_start_from_what_earlier_ones_saw(model_dirs):
    """The server's default policy carries acceptance across requests: after copy-heavy requests
    whose looked-up tokens were accepted, a new request's lookup estimate starts above the prior."""
    from specdec.policy import CHAIN_PRIORS

    LOOKUP_PRIORS = CHAIN_PRIORS["lookup"]

    decoder = specdec.load(model_dirs["llama"], device="cpu", share_acceptance=True)  # as a server builds it: lookup alone here
    live = LiveServer(create_app(decoder, MODEL))
    try:
        assert decoder.policy().accept_probability(("lookup", 1)) == pytest.approx(LOOKUP_PRIORS[1])
        for _ in range(3):
            reply = httpx.post(live.url + "/v1/completions", timeout=60,
                               json={"model": MODEL, "prompt": "ab cd ef ab cd ef ab cd ef ab cd", "max_tokens": 30, "temperature": 0})
            assert reply.status_code == 200
        learnt = decoder.shared_acceptance[None].rates()
    finally:
        live.stop()
    looked_up = [source for source in learnt if source[0] in ("lookup", "copy")]  # a long match is a copy
    assert looked_up
    fresh = decoder.policy()
    for source, rate in learnt.items():  # seeded toward what was seen, from the prior
        prior = CHAIN_PRIORS[source[0]][source[1]] if source in looked_up else fresh.accept_probability(source)
        assert min(rate, prior) - 1e-9 <= fresh.accept_probability(source) <= max(rate, prior) + 1e-9
    assert any(abs(fresh.accept_probability(s) - CHAIN_PRIORS[s[0]][s[1]]) > 0.01 for s in looked_up)


def test_health_says_unhealthy_while_the_batch_is_wedged_and_ok_once_it_moves(model_dirs, monkeypatch):
    """/health is the engine's liveness, not a constant: a batch with work that has not begun a
    round for `stall_seconds` answers 503 (a load balancer or Ray takes the replica out), and 200
    again once it moves."""
    from specdec.server import Service, routes
    service = Service(make_decoder(model_dirs), MODEL, depth=None, stall_seconds=0.3)
    release = threading.Event()
    step = service.batcher.engine.step
    monkeypatch.setattr(service.batcher.engine, "step", lambda states, cap=None: release.wait(20) and step(states, cap))
    live = LiveServer(routes(service))
    try:
        assert httpx.get(live.url + "/health").json()["status"] == "ok"
        with ThreadPoolExecutor(1) as pool:
            reply = pool.submit(httpx.post, live.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4}, timeout=30)
            time.sleep(1.0)
            wedged = httpx.get(live.url + "/health")
            release.set()
            assert reply.result().status_code == 200
        assert wedged.status_code == 503 and wedged.json()["status"].startswith("unhealthy") and wedged.json()["stalled_seconds"] >= 0.3
        assert httpx.get(live.url + "/health").status_code == 200
    finally:
        release.set()
        live.stop()
