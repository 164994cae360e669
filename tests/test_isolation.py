"""One request never ends the others, one tenant never reads another's: a bad prediction is a 400
before it can reach a batch; a failure in one row's drafting or text ends that row alone; kept
caches, histories and learnt acceptance are scoped by API key and `cache_salt` (the cached-prefix
oracle fails across scopes, and works within one, so the test can fail); bounded stores shed
fairly; clean errors for bad text in the library and the CLI; a seeded request repeats whatever
ran before it."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import specdec
from specdec.drafters.history import History
from specdec.drafters.prediction import common_subsequence
from specdec.errors import SpecDecError
from specdec.runtime.base import forward_together
from specdec.runtime.prefix import PrefixCache
from specdec.sampling import RandomStreams, draw, ranked
from specdec.scopes import KeyScope, PerScope, evictee
from specdec.server import create_app
from specdec.verify import verify_tree_coupled
from test_prefix import fed
from test_server import CHAT_TEMPLATE, MODEL, LiveServer, sse_events

SURROGATE = "\ud800"


@pytest.fixture(scope="module")
def auto(model_dirs):
    """The default decoder: prompt lookup and the draft model in one tree, a history, a prefix cache."""
    return specdec.load(model_dirs["llama"], draft=model_dirs["llama-near"], device="cpu")


def post(url: str, body: dict, **headers) -> httpx.Response:
    """JSON with ASCII escapes, so a lone surrogate travels as JSON's \\ud800 (httpx would refuse to encode it)."""
    return httpx.post(url + "/v1/completions", content=json.dumps(body), headers={"content-type": "application/json", **headers},
                      timeout=60)


def stream(url: str, body: dict, **headers) -> list:
    with httpx.stream("POST", url + "/v1/completions", content=json.dumps({**body, "stream": True}),
                      headers={"content-type": "application/json", **headers}, timeout=60) as response:
        return [response.status_code, *sse_events(response)]


def text_of(events: list) -> str:
    return "".join(c["text"] for e in events[1:] if isinstance(e, dict) and "choices" in e for c in e["choices"])


# ---------------------------------------------------------------- one request never ends the others


def test_a_bad_prediction_is_a_400_beside_good_streams_that_finish_exactly(model_dirs, auto):
    """The probe's reproducer: a lone surrogate in the prediction, streamed (with usage) and not,
    with max_tokens 48 and 1, while four greedy streams run; the streams equal offline decoding."""
    decoder = specdec.load(model_dirs["llama"], draft=model_dirs["llama-near"], device="cpu")
    decoder.tokenizer.chat_template = CHAT_TEMPLATE
    live = LiveServer(create_app(decoder, MODEL))
    prompts = ["hi ej", "ab", "ej ej hi", "b a"]
    bad = {"model": MODEL, "prompt": "ab cd", "max_tokens": 48, "temperature": 0,
           "prediction": {"type": "content", "content": f"ab{SURROGATE} cd"}}
    try:
        with ThreadPoolExecutor(8) as pool:
            good = [pool.submit(stream, live.url, {"model": MODEL, "prompt": p, "max_tokens": 40, "temperature": 0}) for p in prompts]
            refused = [pool.submit(post, live.url, bad), pool.submit(post, live.url, {**bad, "max_tokens": 1}),
                       pool.submit(post, live.url, {**bad, "stream": True, "stream_options": {"include_usage": True}})]
            refused = [f.result() for f in refused]
            streams = [f.result() for f in good]
        for reply in refused:
            assert reply.status_code == 400 and reply.json()["error"]["param"] == "prediction", reply.text
            assert "surrogate" in reply.json()["error"]["message"]
        chat = httpx.post(live.url + "/v1/chat/completions", headers={"content-type": "application/json"}, timeout=30,
                          content=json.dumps({"model": MODEL, "messages": [{"role": "user", "content": f"hi{SURROGATE}"}]}))
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages" and "surrogate" in chat.text
        for stop in (f"a{SURROGATE}", ["x", SURROGATE]):  # a stop string no text can hold is refused like the rest
            for path, body in (("completions", {"prompt": "ab"}), ("chat/completions", {"messages": [{"role": "user",
                                                                                                  "content": "hi"}]})):
                for streamed in (False, True):
                    reply = httpx.post(f"{live.url}/v1/{path}", headers={"content-type": "application/json"}, timeout=30,
                                       content=json.dumps({"model": MODEL, **body, "stop": stop, "stream": streamed}))
                    error = reply.json()["error"]
                    assert reply.status_code == 400 and error["param"] == "stop" and "surrogate" in error["message"]
        for prompt, events in zip(prompts, streams):
            assert events[0] == 200 and events[-1] == "[DONE]"
            assert text_of(events) == auto.generate(prompt, max_new_tokens=40, temperature=0).text
    finally:
        live.stop()


class FailingLookup(specdec.PromptLookupDrafter):
    """Prompt lookup that fails for any context holding `poison`."""

    def __init__(self, poison: int):
        super().__init__()
        self.poison = poison

    def propose_one(self, context, max_tokens, sampling, rng):
        if self.poison in context:
            raise RuntimeError("this row's drafter failed")
        return super().propose_one(context, max_tokens, sampling, rng)


def test_a_drafter_failing_for_one_row_ends_that_row_alone(model_dirs, load64):
    """Four streams share steps; the drafter raises for one of them: it ends with an error event and
    [DONE], the other three equal offline decoding with the same drafter; the server goes on."""
    target = specdec.load_model(model_dirs["llama"], device="cpu")
    poison = 13  # "m": only the poisoned prompt holds it
    decoder = specdec.SpeculativeDecoder(target, FailingLookup(poison), gamma=2)
    offline = specdec.SpeculativeDecoder(target, specdec.PromptLookupDrafter(), gamma=2, prefix_cache=None)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6, 4, 5, 6], [poison, 1, 2, 1, 2], [7, 8, 7, 8, 7]]
    live = LiveServer(create_app(decoder, MODEL, depth=None))
    try:
        with ThreadPoolExecutor(4) as pool:
            streams = list(pool.map(lambda p: stream(live.url, {"model": MODEL, "prompt": p, "max_tokens": 30, "temperature": 0}), prompts))
        for prompt, events in zip(prompts, streams):
            assert events[0] == 200 and events[-1] == "[DONE]"
            errors = [e for e in events[1:-1] if isinstance(e, dict) and "error" in e]
            if poison in prompt:
                assert len(errors) == 1 and "this row's drafter failed" in errors[0]["error"]["message"]
            else:
                assert not errors and text_of(events) == offline.generate(prompt, max_new_tokens=30, temperature=0).text
        after = post(live.url, {"model": MODEL, "prompt": prompts[0], "max_tokens": 5, "temperature": 0})
        assert after.status_code == 200
    finally:
        live.stop()


def test_the_engine_ends_a_failing_row_and_steps_the_others():
    """`forward_together` hands back a failing row's exception and goes on with the others; a
    failing shared forward raises."""
    class Model:
        def __init__(self, fail=False):
            self.fail = fail

        def forward_batch(self, feeds):
            if self.fail:
                raise RuntimeError("the forward failed")
            return [feed * 10 for feed in feeds]

    def grower(values, fail_at=None):
        total = 0
        for i, value in enumerate(values):
            if i == fail_at:
                raise ValueError("row failed")
            total += yield value
        return total

    results = forward_together(Model(), [grower([1, 2]), grower([3, 4], fail_at=1), grower([5])])
    assert results[0] == 30 and isinstance(results[1], ValueError) and results[2] == 50
    with pytest.raises(RuntimeError, match="forward failed"):
        forward_together(Model(fail=True), [grower([1])])


def test_a_reply_that_cannot_be_made_is_an_answer_in_the_apis_shape(model_dirs, monkeypatch):
    """Whatever fails while the reply is made: JSON 500 for a whole reply, an error event and [DONE]
    for a stream (here: its usage chunk)."""
    from specdec.server.openai import Reply

    def broken(self, result):
        raise UnicodeEncodeError("utf-8", "x", 0, 1, "surrogates not allowed")

    decoder = specdec.load(model_dirs["llama"], device="cpu")
    live = LiveServer(create_app(decoder, MODEL))
    monkeypatch.setattr(Reply, "whole", broken)
    monkeypatch.setattr(Reply, "usage_chunk", broken)
    body = {"model": MODEL, "prompt": "ab", "max_tokens": 4, "temperature": 0}
    try:
        whole = post(live.url, body)
        assert whole.status_code == 500 and "UnicodeEncodeError" in whole.json()["error"]["message"]
        events = stream(live.url, {**body, "stream_options": {"include_usage": True}})
        assert events[-1] == "[DONE]" and "error" in events[-2] and "UnicodeEncodeError" in events[-2]["error"]["message"]
    finally:
        live.stop()


# ---------------------------------------------------------------- one tenant never reads another's


SYSTEM = [(5 * i + 2) % 15 + 1 for i in range(20)]  # a known system prompt, 20 token ids
PIN = [3, 9, 14, 6]


def recover_pin(url: str, headers: dict, salt: str | None = None) -> tuple[list[int], list[int]]:
    """The probe's attack: the PIN digit by digit, keeping the guess whose max_tokens-0 request
    reports the most cached tokens. Returns (the guess, every cached_tokens seen)."""
    guess, seen = [], []
    for _ in PIN:
        best, best_cached = None, -1
        for digit in range(1, 16):
            body = {"model": MODEL, "prompt": SYSTEM + guess + [digit, 1], "max_tokens": 0, "temperature": 0}
            if salt is not None:
                body["cache_salt"] = salt
            reply = post(url, body, **headers)
            assert reply.status_code == 200, reply.text
            cached = reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            seen.append(cached)
            if cached > best_cached:
                best, best_cached = digit, cached
        guess.append(best)
    return guess, seen


def test_the_cached_prefix_oracle_fails_across_keys_and_salts(model_dirs):
    """Alice sends her PIN after a known system prompt. Mallory, with another key, sees 0 cached
    tokens for every probe and recovers nothing; so does Alice's own key under another salt. With
    her own key and salt the probe works (the oracle exists within a scope: the test can fail)."""
    decoder = specdec.load(model_dirs["llama"], device="cpu")
    live = LiveServer(create_app(decoder, MODEL, api_keys=["alice-key", "mallory-key"]))
    alice, mallory = {"Authorization": "Bearer alice-key"}, {"Authorization": "Bearer mallory-key"}
    try:
        sent = post(live.url, {"model": MODEL, "prompt": SYSTEM + PIN + [1], "max_tokens": 2, "temperature": 0, "cache_salt": "s"}, **alice)
        assert sent.status_code == 200
        _, seen = recover_pin(live.url, mallory)
        assert set(seen) == {0}, "another key's requests saw a cached prefix"
        _, seen = recover_pin(live.url, alice, salt="other")
        assert set(seen) == {0}, "another salt's requests saw a cached prefix"
        guess, _ = recover_pin(live.url, alice, salt="s")
        assert guess == PIN, "within one scope the oracle works, so the checks above could have failed"
        unauthorized = httpx.get(live.url + "/metrics")
        assert unauthorized.status_code == 401 and httpx.get(live.url + "/metrics", headers=alice).status_code == 403
    finally:
        live.stop()


def test_keys_share_caches_only_when_told(model_dirs):
    decoder = specdec.load(model_dirs["llama"], device="cpu")
    live = LiveServer(create_app(decoder, MODEL, api_keys=["a", "b"], keys_share_caches=True, public_metrics=True))
    try:
        assert post(live.url, {"model": MODEL, "prompt": SYSTEM + PIN + [1], "max_tokens": 1}, Authorization="Bearer a").status_code == 200
        probe = post(live.url, {"model": MODEL, "prompt": SYSTEM + [1], "max_tokens": 0}, Authorization="Bearer b")
        assert probe.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(SYSTEM)
        assert httpx.get(live.url + "/metrics").status_code == 200
    finally:
        live.stop()


def test_evictee_takes_from_the_scope_holding_the_most():
    entries = [("a", 5), ("b", 1), ("a", 5), ("c", 2), ("b", 1)]  # least recently used first
    assert evictee(entries, lambda e: e[0]) == ("a", 5)  # a and b hold two entries each: a's oldest is the oldest
    assert evictee(entries, lambda e: e[0], weight=lambda e: e[1]) == ("a", 5)
    assert evictee(entries[1:4], lambda e: e[0], weight=lambda e: e[1]) == ("a", 5)
    assert evictee([("b", 1), ("c", 3)], lambda e: e[0], weight=lambda e: e[1]) == ("c", 3)
    made = PerScope(list, limit=2)
    made["x"].append(1)
    made["y"], made["z"]
    assert made["x"] == [], "the least recently used scope was forgotten"


def test_a_scope_flooding_the_prefix_cache_cannot_evict_another_holding_less_than_half(load64, model_dirs):
    model = load64(model_dirs["llama"])
    cache = PrefixCache(model, budget=100, min_shared=4)
    kept = [(7 * i + 3) % 16 for i in range(45)]
    cache.put(fed(model, kept), kept, scope="victim")
    rng = random.Random(0)
    for _ in range(20):  # 30-token prompts of another scope, each new
        flood = [rng.randrange(16) for _ in range(30)]
        cache.put(fed(model, flood), flood, scope="flood")
        assert cache.tokens <= 100
    taken = cache.take(kept + [1], scope="victim")
    assert taken.cache_len == 45, "the victim's prefix survived the flood"
    assert cache.take(kept + [1], scope="flood").cache_len == 0, "and only its own scope sees it"
    taken.release()
    big = [(3 * i + 1) % 16 for i in range(60)]  # more than half: the flood's own entries go first, then it may be evicted
    cache.put(fed(model, big), big, scope="flood")
    assert cache.tokens <= 100


def test_a_turn_the_cache_refuses_leaves_its_earlier_turn_kept(load64, model_dirs):
    """A scope's longer turn replaces its earlier one only when it is kept itself: here it would make
    its scope the heaviest, so it is refused and the earlier turn stays."""
    model = load64(model_dirs["llama"])
    cache = PrefixCache(model, budget=100, min_shared=4)
    turn = [(5 * i + 1) % 16 for i in range(40)]
    for scope, tokens in (("a", turn[:25]), ("b", [3] * 35), ("c", [4] * 35)):
        cache.put(fed(model, tokens), tokens, scope=scope)
    cache.put(fed(model, turn), turn, scope="a")
    assert cache.tokens == 95
    taken = cache.take(turn[:25] + [1], scope="a")
    assert taken.cache_len == 25
    taken.release()


def test_a_history_is_scoped_and_narrowed_by_its_user_and_shed_fairly():
    history = History(tenants=4)
    history.record("ann", [1, 2, 3, 4, 5, 6], scope="key-a")
    assert history.view("ann", scope="key-a").proposal([9, 1, 2, 3], 3) == [4, 5, 6]
    assert history.view("ann", scope="key-b").proposal([9, 1, 2, 3], 3) == [], "a user of another scope is another tenant"
    assert history.view("bob", scope="key-a").proposal([9, 1, 2, 3], 3) == [], "a user narrows the scope"
    shared = History(shared=True)
    shared.record("ann", [1, 2, 3, 4, 5, 6], scope="key-a")
    assert shared.view("bob", scope="key-a").proposal([9, 1, 2, 3], 3) == [4, 5, 6]
    assert shared.view("bob", scope="key-b").proposal([9, 1, 2, 3], 3) == [], "sharing stays within the scope"
    for user in range(20):  # one scope invents users
        history.record(f"u{user}", [7, 8, 9], scope="key-b")
    assert history.size("ann", scope="key-a") == 6, "a scope keeping fewer tenants is not pushed out"
    keyed = History(tenants=4)
    keyed.record("ann", [1, 2, 3], scope=KeyScope(0, None))
    for salt in range(20):  # one key invents salts: they narrow what it sees, they do not earn it room
        keyed.record("bob", [7, 8, 9], scope=KeyScope(1, f"salt{salt}"))
    assert keyed.size("ann", scope=KeyScope(0, None)) == 3


# ---------------------------------------------------------------- the same care outside the server


def test_bad_text_and_tenants_are_clean_errors_in_the_library(auto):
    with pytest.raises(SpecDecError, match="surrogate"):
        auto.generate(f"ab{SURROGATE}", max_new_tokens=2)
    with pytest.raises(SpecDecError, match="surrogate") as raised:
        auto.request("ab", max_new_tokens=2, prediction=f"cd{SURROGATE}")
    assert raised.value.param == "prediction"
    with pytest.raises(SpecDecError, match="stop string is not valid Unicode") as raised:
        auto.request("ab", max_new_tokens=2, stop=["x", f"cd{SURROGATE}"])
    assert raised.value.param == "stop"
    with pytest.raises(SpecDecError, match="tenant must be hashable"):
        auto.request("ab", tenant=["a"])
    with pytest.raises(SpecDecError, match="scope must be hashable"):
        auto.request("ab", scope={"a": 1})


def test_an_invalid_utf8_byte_in_a_cli_prompt_is_a_clean_error(model_dirs, capsys):
    from specdec.cli import main

    prompt = b"ab\xffcd".decode("utf-8", "surrogateescape")  # how Python hands a command line's bytes to argv
    assert main(["generate", prompt, "--target", model_dirs["llama"], "--device", "cpu", "--max-new-tokens", "2"]) == 1
    assert "not valid UTF-8: byte 0xff at character 2" in capsys.readouterr().err


def test_api_key_files_are_read_before_anything_loads(tmp_path, capsys, monkeypatch):
    from specdec.cli import build_parser, main
    from specdec.cli.arguments import config_options
    from specdec.config import serve_config

    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    assert main(["serve", "--api-key-file", str(tmp_path / "missing")]) == 1
    assert "cannot read the API key file" in capsys.readouterr().err
    (tmp_path / "keys").write_text("# tenants\nalpha\n\n  beta  \nalpha\n")
    args = build_parser().parse_args(["serve", "--api-key", "gamma", "--api-key-file", str(tmp_path / "keys")])
    assert serve_config(config_options(args)).api_keys == ("gamma", "alpha", "beta")
    (tmp_path / "empty").write_text("# none yet\n")
    assert main(["serve", "--api-key-file", str(tmp_path / "empty")]) == 1 and "holds no key" in capsys.readouterr().err


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=40), st.lists(st.integers(0, 4), max_size=40))
def test_the_prediction_count_is_a_longest_common_subsequence(a, b):
    """Bit-parallel against the textbook dynamic programme."""
    row = [0] * (len(b) + 1)
    for x in a:
        new = [0]
        for j, y in enumerate(b):
            new.append(row[j] + 1 if x == y else max(row[j + 1], new[j]))
        row = new
    assert common_subsequence(a, b) == row[-1]


# ---------------------------------------------------------------- seeds


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32 - 1), st.lists(st.integers(-1, 6), min_size=0, max_size=7))
def test_coupled_verification_emits_what_plain_sampling_draws(seed, parent_choices):
    """Whatever the point-mass tree, each emitted token is the token plain sampling draws with the
    same noise from the same distribution (the tree only decides how many come from one forward)."""
    generator = torch.Generator().manual_seed(seed)
    n = len(parent_choices)
    parents = torch.tensor([min(p, i - 1) for i, p in enumerate(parent_choices)], dtype=torch.long)
    tokens = torch.randint(0, 6, (n,), generator=generator)
    target_probs = torch.softmax(torch.randn(n + 1, 6, generator=generator, dtype=torch.float64) * 2, dim=-1)
    noise = [torch.empty(6, dtype=torch.float64).exponential_(generator=generator) for _ in range(n + 1)]
    result = verify_tree_coupled(tokens, parents, target_probs, lambda j: noise[j])
    rows = [0] + [1 + node for node in result.path]
    assert result.tokens == [draw(target_probs[row], noise[j]) for j, row in enumerate(rows)]
    assert len(result.tokens) == result.accepted + 1


def test_a_draw_with_exponential_noise_follows_its_distribution_and_couples_two():
    """Gumbel-max, exactly: the frequencies of argmax(p / E) follow p (chi-square, false-failure
    odds 1e-4), and a q close to p draws the same token at least (1 - TV) / (1 + TV) of the time."""
    from scipy.stats import chisquare

    generator = torch.Generator().manual_seed(3)
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0], dtype=torch.float64)
    q = torch.tensor([0.4, 0.3, 0.1, 0.1, 0.05, 0.05], dtype=torch.float64)
    counts, same = [0] * 6, 0
    for _ in range(20_000):
        noise = torch.empty(6, dtype=torch.float64).exponential_(generator=generator)
        token = draw(p, noise)
        counts[token] += 1
        same += token == draw(q, noise)
        assert ranked(p, noise, 3)[0] == token and len(set(ranked(p, noise, 6))) == 5, "a token of probability 0 is never ranked"
    assert counts[5] == 0 and chisquare(counts[:5], [20_000 * float(x) for x in p[:5]]).pvalue > 1e-4
    tv = 0.5 * float((p - q).abs().sum())
    assert same / 20_000 > (1 - tv) / (1 + tv)


def test_keyed_noise_depends_on_the_seed_and_position_alone():
    streams = RandomStreams(7, keyed=True)
    first = [streams.noise(i, 8) for i in range(5)]
    again = RandomStreams(7, keyed=True)
    assert all(torch.equal(again.noise(i, 8), first[i]) for i in reversed(range(5)))
    assert all((e > 0).all() for e in first) and not torch.equal(RandomStreams(8, keyed=True).noise(0, 8), first[0])


def test_a_seeded_request_repeats_on_one_decoder_whatever_ran_before(model_dirs, auto):
    """The default decoder's history and learnt costs change what it drafts; a seeded sampled
    request's text does not change: it is plain decoding's with the same seed."""
    decoder = specdec.load(model_dirs["llama"], draft=model_dirs["llama-near"], device="cpu")
    plain = specdec.load(model_dirs["llama"], plain=True, device="cpu")
    options = dict(max_new_tokens=40, temperature=0.8, top_p=0.95, seed=11)
    first = decoder.generate("ab cd ab", **options)
    for prompt in ["ab cd ab", "hi ej", first.text]:  # the history now holds the first reply
        decoder.generate(prompt, max_new_tokens=30, temperature=1.0)
    again = decoder.generate("ab cd ab", **options)
    assert again.text == first.text == plain.generate("ab cd ab", **options).text
    assert again.stats.source_trials.get("history", (0, 0))[0] > 0, "the repeat drafted from the history, and still repeated"
    assert first.stats.accepted > 0
