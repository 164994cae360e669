"""`specdec serve`: the real server on a loopback port with tiny saved models, reached with httpx
and the official openai client; concurrency, disconnects, bad input and a schema fuzz."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import specdec
from specdec.server import create_app
from specdec.server.http import Server, config

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
MODEL = "tiny"


def free_port() -> int:
    """A port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """The app under `specdec serve`'s own uvicorn settings (deadlines, connection cap), in a thread."""

    def __init__(self, app, **options):
        self.port = free_port()
        self.server = Server(config(app, "127.0.0.1", self.port, **options), shutdown_timeout=options.get("shutdown_timeout", 10.0))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


def wait_until_up(process, url: str, seconds: float = 60) -> None:
    """A `specdec serve` subprocess answers /health (or the test fails when it exits or takes too long)."""
    deadline = time.time() + seconds
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert process.poll() is None and time.time() < deadline, "specdec serve did not come up"
        time.sleep(0.2)


def make_decoder(model_dirs, chat_template=True):
    decoder = specdec.load(model_dirs["llama"], draft=model_dirs["llama-near"], gamma=3, device="cpu")
    if chat_template:
        decoder.tokenizer.chat_template = CHAT_TEMPLATE
    return decoder


@pytest.fixture(scope="module")
def decoder(model_dirs):
    return make_decoder(model_dirs)


@pytest.fixture(scope="module")
def server(decoder):
    live = LiveServer(create_app(decoder, MODEL, max_queue=32, depth=None))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def offline(model_dirs):
    """A second decoder over the same checkpoints, for what offline generate says."""
    return make_decoder(model_dirs)


def sse_events(response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_completion_matches_offline_generate(server, offline):
    body = {"model": MODEL, "prompt": "hi ej", "max_tokens": 20, "temperature": 0}
    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()
    want = offline.generate("hi ej", max_new_tokens=20, temperature=0)
    assert reply["object"] == "text_completion" and reply["model"] == MODEL
    assert reply["choices"][0]["text"] == want.text and reply["choices"][0]["finish_reason"] == want.finish_reason
    assert reply["usage"] == {"prompt_tokens": len(offline.prompt_ids("hi ej")), "completion_tokens": len(want.tokens),
                              "total_tokens": len(offline.prompt_ids("hi ej")) + len(want.tokens), "prompt_tokens_details": {"cached_tokens": 0}}
    spec = reply["speculative"]
    assert 0 <= spec["acceptance_rate"] <= 1 and spec["tokens_per_target_forward"] >= 1


@pytest.mark.parametrize("extreme", [{"temperature": 1e-300}, {"top_p": 5e-324}])
def test_a_vanishing_temperature_or_top_p_serves_greedy_text(server, offline, extreme):
    """Finding: these passed validation and underflowed to NaN (garbage text with a 200) in float32."""
    body = {"model": MODEL, "prompt": "hi ej", "max_tokens": 20, "seed": 5, **extreme}
    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()
    assert reply["choices"][0]["text"] == offline.generate("hi ej", max_new_tokens=20, temperature=0).text


def test_streamed_completion_with_usage(server, offline):
    body = {"model": MODEL, "prompt": "hi ej", "max_tokens": 20, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 20 and "speculative" in usage
    text = "".join(e["choices"][0]["text"] for e in events[:-2])
    assert text == offline.generate("hi ej", max_new_tokens=20, temperature=0).text
    assert events[-3]["choices"][0]["finish_reason"] == "length"


def test_openai_client_completions_and_chat(server, offline):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == [MODEL]
    done = client.completions.create(model=MODEL, prompt="hi ej", max_tokens=12, temperature=0, seed=1)
    assert done.choices[0].text == offline.generate("hi ej", max_new_tokens=12, temperature=0).text
    assert done.model_extra["speculative"]["tokens_per_target_forward"] >= 1  # the extension field, as the README reads it
    streamed = client.completions.create(model=MODEL, prompt="hi ej", max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text
    messages = [{"role": "user", "content": "abc"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    templated = offline.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert templated == "abc "
    want = offline.generate(templated, max_new_tokens=10, temperature=0)
    assert chat.choices[0].message.content == want.text and chat.usage.completion_tokens == len(want.tokens)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == len(want.tokens)


def test_sampling_with_a_seed_is_repeatable(server):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 16, "temperature": 0.9, "top_k": 8, "top_p": 0.95, "seed": 7,
            "stop": ["zz"]}
    first = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()
    second = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()
    assert first["choices"][0]["text"] == second["choices"][0]["text"]


def test_sixteen_parallel_streams_each_equal_offline_generate(server, offline):
    prompts = [f"h{'ij'[i % 2]} e{chr(97 + i)}" for i in range(16)]
    want = {p: offline.generate(p, max_new_tokens=24, temperature=0).text for p in prompts}

    def stream(prompt):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            events = sse_events(response)
        assert events[-1] == "[DONE]"
        return "".join(e["choices"][0]["text"] for e in events[:-1])

    with ThreadPoolExecutor(16) as pool:
        got = dict(zip(prompts, pool.map(stream, prompts)))
    assert got == want


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ") or line.startswith(name + "{")]
    return sum(values)


class SlowDrafter:
    """The draft model, 50 ms slower per proposal: a generation long enough to walk away from."""

    def __init__(self, inner):
        self.inner, self.name = inner, "slow"

    def __getattr__(self, name):  # what it declares (`Drafter`) is the wrapped drafter's
        return getattr(self.inner, name)

    def open(self, prompt):
        return self.inner.open(prompt)

    def prefill(self, slot, budget=None):
        return self.inner.prefill(slot, budget)

    def accept(self, slot, tokens):
        self.inner.accept(slot, tokens)

    def close(self, slot):
        self.inner.close(slot)

    def propose(self, requests):
        time.sleep(0.05)
        return self.inner.propose(requests)


def test_a_client_that_disconnects_is_cancelled(model_dirs):
    decoder = make_decoder(model_dirs)
    decoder.drafter = SlowDrafter(decoder.drafter)
    live = LiveServer(create_app(decoder, MODEL))
    body = {"model": MODEL, "prompt": "hi ej", "max_tokens": 50, "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=30) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    break  # one event, then hang up: 50 tokens would take >= 0.8 s more
        hung_up = time.time()
        while metric(live, "specdec_cancelled_total") < 1:
            assert time.time() < hung_up + 5, "the generation was not cancelled"
            time.sleep(0.02)
        assert time.time() - hung_up < 0.6, "cancelled promptly, before the generation could finish"
        assert metric(live, "specdec_generated_tokens_total") == 0  # it never finished
        reply = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2}, timeout=10)
        assert reply.status_code == 200  # the slot is free
    finally:
        live.stop()


BAD = [
    ("malformed JSON", b"{\"model\": ", 400, None),
    ("wrong type", {"model": MODEL, "prompt": "a", "max_tokens": "ten"}, 400, "max_tokens"),
    ("unknown model", {"model": "gpt-9", "prompt": "a"}, 404, "model"),
    ("max_tokens beyond the context", {"model": MODEL, "prompt": "a", "max_tokens": 10_000}, 400, "max_tokens"),
    ("negative temperature", {"model": MODEL, "prompt": "a", "temperature": -1}, 400, "temperature"),
    ("prompt too long", {"model": MODEL, "prompt": "ab" * 200}, 400, "prompt"),
    ("prompt too long, tokenized off the loop", {"model": MODEL, "prompt": "ab" * 15_000}, 400, "prompt"),
    ("empty prompt", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("n = 17", {"model": MODEL, "prompt": "a", "n": 17}, 400, "n"),
    ("top_p 0", {"model": MODEL, "prompt": "a", "top_p": 0}, 400, "top_p"),
    ("missing prompt", {"model": MODEL}, 400, "prompt"),
    ("empty stop", {"model": MODEL, "prompt": "a", "stop": [""]}, 400, "stop"),
    ("oversized body", {"model": MODEL, "prompt": "a" * (2 << 20)}, 413, None),
    ("a lone surrogate", {"model": MODEL, "prompt": "a\ud800b"}, 400, "prompt"),
    ("chat without messages", {"model": MODEL, "messages": []}, 400, "messages"),
    # OpenAI's types are strict: nothing is coerced
    ("max_tokens true", {"model": MODEL, "prompt": "a", "max_tokens": True}, 400, "max_tokens"),
    ("max_tokens 2.0", {"model": MODEL, "prompt": "a", "max_tokens": 2.0}, 400, "max_tokens"),
    ("stream as a string", {"model": MODEL, "prompt": "a", "stream": "yes"}, 400, "stream"),
    ("temperature as a string", {"model": MODEL, "prompt": "a", "temperature": "0.5"}, 400, "temperature"),
    ("top_k 2**64", {"model": MODEL, "prompt": "a", "top_k": 2**64}, 400, "top_k"),
    ("token ids as booleans", {"model": MODEL, "prompt": [True, False]}, 400, "prompt"),
    ("chat logprobs as a number", {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "logprobs": 1}, 400, "logprobs"),
]


@pytest.mark.parametrize("name,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_an_openai_error(server, name, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    response = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if param:
        assert error["param"] and param in error["param"]
    else:
        assert error["param"] is None  # malformed JSON has no field to name (its loc is a character offset)


def test_chat_without_a_template_is_a_400(model_dirs):
    live = LiveServer(create_app(make_decoder(model_dirs, chat_template=False), MODEL))
    try:
        response = httpx.post(live.url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "a"}]}, timeout=30)
        assert response.status_code == 400 and "chat template" in response.json()["error"]["message"]
    finally:
        live.stop()


def test_a_full_queue_gets_429(model_dirs):
    decoder = make_decoder(model_dirs)
    decoder.drafter = SlowDrafter(decoder.drafter)  # each request takes >= 0.5 s: the six overlap
    live = LiveServer(create_app(decoder, MODEL, max_queue=1, max_batch=1))
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 12, "temperature": 0}
    try:
        with ThreadPoolExecutor(6) as pool:
            # the first runs before the others arrive (six at once raced the batch thread's admission:
            # all could find the first still waiting, and only it was served)
            first = pool.submit(httpx.post, live.url + "/v1/completions", json=body, timeout=60)
            deadline = time.time() + 10
            while httpx.get(live.url + "/health").json()["batch_size"] < 1:
                assert time.time() < deadline, "the first request did not start"
                time.sleep(0.01)
            others = list(pool.map(lambda _: httpx.post(live.url + "/v1/completions", json=body, timeout=60), range(5)))
            replies = [first.result()] + others
        statuses = [r.status_code for r in replies]
        assert statuses.count(200) >= 2 and 429 in statuses and set(statuses) <= {200, 429}
        assert all(r.json()["error"]["type"] == "rate_limit_error" and r.headers["retry-after"] == "1" for r in replies if r.status_code == 429)
        assert httpx.post(live.url + "/v1/completions", json=body, timeout=60).status_code == 200
        assert metric(live, 'specdec_requests_total{endpoint="/v1/completions",status="429"}') == statuses.count(429)
    finally:
        live.stop()


def test_explicit_nulls_mean_defaults_and_a_body_needs_a_length(server):
    body = {"model": MODEL, "prompt": "ab", "max_tokens": 3, "temperature": None, "top_p": None, "top_k": None,
            "n": None, "stream": None, "stop": None, "seed": None}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 200
    chunked = httpx.post(server.url + "/v1/completions", content=iter([json.dumps(body).encode()]), timeout=30)
    assert chunked.status_code == 411 and chunked.json()["error"]["message"]


def test_health_models_and_metrics(server):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    text = httpx.get(server.url + "/metrics").text
    for name in ("specdec_requests_total", "specdec_generated_tokens_total", "specdec_acceptance_rate",
                 "specdec_tokens_per_second", "specdec_queue_depth", "specdec_tokens_per_target_forward"):
        assert name in text
    assert metric(server, "specdec_generated_tokens_total") > 0


def test_specdec_serve_command(model_dirs):
    """The console entry point: serves until stopped; a port that is taken is a clear error."""
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "specdec", "serve", "--target", model_dirs["llama"], "--draft", model_dirs["llama-near"],
               "--port", str(port), "--model-name", "t", "--device", "cpu"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_up(process, f"http://127.0.0.1:{port}")
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "t", "prompt": "ab", "max_tokens": 5}, timeout=30)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 5
        taken = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert taken.returncode != 0 and "Traceback" not in taken.stderr
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_n_choices_are_rows_of_the_batch_each_its_own_seeded_sample(server, offline):
    """n = 3, seeded: choice i is what the library writes with seed + i; usage counts every choice; a stream
    carries each choice's chunks by index, the same texts; n above the cap is a 400 naming it."""
    body = {"model": MODEL, "prompt": "hi ej", "max_tokens": 10, "temperature": 0.9, "seed": 40, "n": 3}
    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()
    wanted = [offline.generate("hi ej", max_new_tokens=10, temperature=0.9, seed=40 + i) for i in range(3)]
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    assert [c["text"] for c in reply["choices"]] == [w.text for w in wanted]
    assert len({w.text for w in wanted}) > 1  # the choices differ
    assert reply["usage"]["completion_tokens"] == sum(len(w.tokens) for w in wanted)
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=30,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,
                            "temperature": 0.9, "seed": 7, "n": 2, "stream": True,
                            "stream_options": {"include_usage": True}}) as response:
        events = [e for e in sse_events(response) if e != "[DONE]"]
    texts, finished = ["", ""], set()
    for event in events:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["delta"].get("content", "")
            if choice["finish_reason"]:
                finished.add(choice["index"])
    whole = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "temperature": 0.9,
        "seed": 7, "n": 2}).json()
    assert finished == {0, 1} and texts == [c["message"]["content"] for c in whole["choices"]]
    assert events[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    too_many = httpx.post(server.url + "/v1/completions", json={**body, "n": 17}, timeout=10)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
