"""Structured outputs (`specdec.constraints`): every row of a draft is verified against the target's
distribution restricted to what the grammar allows on that row's path, so constrained speculation
keeps constrained plain decoding's output exactly: one step enumerated exactly (chains and trees),
the joint of sampled output by chi-square, greedy text equal to plain on every architecture and on
llama.cpp; every output matches its constraint; bad constraints are refused by name."""

from __future__ import annotations

import json
import zlib
from collections import Counter

import pytest
import torch

import specdec
from specdec.constraints import Constraint, Matcher
from specdec.drafters import ModelDrafter, TreeShape
from specdec.drafters.base import DraftRequest
from specdec.errors import SpecDecError
from specdec.params import SamplingParams
from specdec.sampling import probs_from_logits
from specdec.verify import verify_tree
from conftest import ARCHS
from reference import path_to
from test_statistical import SAMPLES, chi_square_pvalue
from test_tree_exact import TableLM
from tiny import save_tiny_model
from test_verify_exact import Conditional, completions, enumerator, target_joint  # noqa: F401 (enumerator: a fixture)

# a tiny vocabulary for exact enumeration: a, b, c and an end token
TINY_PIECES = [b"a", b"b", b"c", b"\xff<eos>"]
TINY_GRAMMAR = "(a|bc|cb)*"  # after "b" only "c", after "c" only "b"; a, b, c or the end elsewhere
TINY_PROMPT = (0, 1, 2)


class TinyTokenizer:
    """What llguidance asks of a tokenizer, for TINY_PIECES."""

    tokens, eos_token_id, bos_token_id = TINY_PIECES, 3, None

    def __call__(self, text):
        return [b"abc".index(bytes([byte])) for byte in (text.encode() if isinstance(text, str) else text)]


@pytest.fixture(scope="module")
def tiny_matcher():
    """A fresh matcher of TINY_GRAMMAR at the start of the output, each time it is called."""
    from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper, grammar_from

    tokenizer = LLTokenizer(TokenizerWrapper(TinyTokenizer()))
    grammar = grammar_from("regex", TINY_GRAMMAR)
    return lambda: Matcher(LLMatcher(tokenizer, grammar), len(TINY_PIECES))


def after(make_matcher, history) -> Matcher:
    """A new matcher that has read `history` token by token (None if the grammar refuses it)."""
    matcher = make_matcher()
    for token in history:
        if matcher._matcher.validate_tokens([token]) != 1:
            return None
        matcher.advance([token])
    return matcher


class Constrained:
    """p_c: the target's rows times what the grammar allows after each history, renormalised (a history
    the grammar refuses is never reached: its row stays the target's). A table as `Conditional` is."""

    def __init__(self, target: Conditional, make_matcher):
        self.target, self.make_matcher, self.vocab, self.rows = target, make_matcher, target.vocab, {}

    def __call__(self, history: tuple[int, ...]) -> torch.Tensor:
        if history not in self.rows:
            row, matcher = self.target(history), after(self.make_matcher, history)
            if matcher is not None:
                row = row * matcher.allowed().double()
            self.rows[history] = row / row.sum()
        return self.rows[history]


def test_each_row_is_masked_on_its_own_path_and_the_matcher_does_not_move(tiny_matcher):
    """A tree with an allowed branch, a forbidden node and a node below it: each row's mask is what a
    new matcher allows after that row's path; a forbidden node's subtree is left as the target gave it."""
    matcher = after(tiny_matcher, [1])  # "b": only "c" may follow
    tokens, parents = [2, 1, 0, 1, 2], [-1, 0, 0, -1, 3]  # c (c b, c a), b (b c): "b" at the root is forbidden
    logits = torch.zeros(len(tokens) + 1, len(TINY_PIECES))
    masked = matcher.shape(logits, tokens, parents)
    for row, node in enumerate([None, *range(len(tokens))]):
        path = [] if node is None else [tokens[i] for i in path_to(torch.tensor(parents), node)]
        reference = after(tiny_matcher, [1, *path])
        if reference is None:
            assert torch.equal(masked[row], logits[row]), f"row {row} is unreachable: left as it was"
        else:
            assert torch.equal(masked[row] == 0, reference.allowed()), f"row {row}"
    assert torch.equal(matcher.allowed(), after(tiny_matcher, [1]).allowed())


@pytest.mark.parametrize("tree", [None, TreeShape(5, 2)], ids=["chain", "tree"])
def test_one_constrained_step_keeps_the_constrained_target_exactly(enumerator, tiny_matcher, tree):
    """One draft (a draft model's chain or tree, drawn from an unconstrained q, so the grammar forbids
    some of its tokens) verified against the masked target: the joint of the step and what follows is
    p_c's, every draw enumerated."""
    target, draft = Conditional(4, seed=61), Conditional(4, seed=62)
    target_c, depth = Constrained(target, tiny_matcher), 3

    def iteration():
        drafter = ModelDrafter(TableLM(draft, TINY_PROMPT), tree=tree)
        proposal = drafter.propose([DraftRequest(drafter.open(TINY_PROMPT), list(TINY_PROMPT), depth,
                                                 SamplingParams(temperature=1.0), None)])[0]
        paths = [path_to(proposal.parents, node) for node in range(len(proposal))]
        histories = [()] + [tuple(proposal.tokens[path].tolist()) for path in paths]
        logits = torch.stack([target(h).log() for h in histories])
        masked = tiny_matcher().shape(logits, proposal.tokens.tolist(), proposal.parents.tolist())
        probs = probs_from_logits(masked, SamplingParams(temperature=1.0))
        return tuple(verify_tree(proposal.tokens, proposal.parents, proposal.probs, probs, None, None,
                                 proposal.columns).tokens)

    joint, forbidden_drafted = {}, False
    for output, weight in enumerator.run(iteration):
        for seq, tail in completions(target_c, output, depth + 1):
            joint[seq] = joint.get(seq, 0.0) + weight * tail
    for seq, p in target_joint(target_c, depth + 1).items():
        assert abs(joint.get(seq, 0.0) - p) < 1e-9, seq
        forbidden_drafted |= p == 0 and any(draft(seq[:i])[t] > 0 for i, t in enumerate(seq))
    assert forbidden_drafted, "the draft proposes tokens the grammar forbids"


# ------------------------------------------------------------------ end to end, through the public API

@pytest.fixture(scope="module")
def eos_dirs(tmp_path_factory) -> dict[str, str]:
    """Each architecture's tiny target and one-layer draft with an end token (a complete grammar ends on it)."""
    root, dirs = tmp_path_factory.mktemp("eos-models"), {}
    for seed, arch in enumerate(ARCHS):
        dirs[arch] = str(save_tiny_model(root / arch, arch, seed=seed, with_eos=True))
        dirs[f"{arch}-draft"] = str(save_tiny_model(root / f"{arch}-draft", arch, seed=100 + seed, layers=1,
                                                    with_eos=True))
    return dirs


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "count"], "additionalProperties": False}


def test_greedy_constrained_speculation_equals_constrained_plain_on_every_architecture(eos_dirs):
    """Every drafter kind under a regular expression the tiny models would not write by themselves
    (at most 13 characters, one token each: the end token is forced once it is complete; no space, which
    the tiny Qwen2 tokenizer cannot encode)."""
    constraint = Constraint.regex("[a-f]{3}([g-m]{2,4}[a-f]){1,2}")
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    for arch in ARCHS:
        plain = specdec.load(eos_dirs[arch], plain=True, dtype="float64")
        reference = plain.generate(prompt, constraint=constraint, temperature=0, max_new_tokens=20)
        assert reference.finish_reason == "stop" and constraint.check(reference.text), (arch, reference.text)
        for options in (dict(), dict(gamma=3), dict(gamma=2, tree=6), dict(prompt_lookup=True, gamma=4)):
            draft = None if "prompt_lookup" in options else eos_dirs[f"{arch}-draft"]
            decoder = specdec.load(eos_dirs[arch], draft, dtype="float64", **options)
            result = decoder.generate(prompt, constraint=constraint, temperature=0, max_new_tokens=20)
            assert result.tokens == reference.tokens, (arch, options)


def test_forced_text_is_drafted_and_the_output_is_constrained_plain_decodings(eos_dirs):
    """Where the grammar leaves one way on, the default drafts it ("forced") and its text, sampled
    with a seed and greedy, is constrained plain decoding's."""
    constraint = Constraint.regex("abc(d|e)fghi(j|k)lm(a|b)+")
    plain = specdec.load(eos_dirs["llama"], plain=True, dtype="float64")
    default = specdec.load(eos_dirs["llama"], eos_dirs["llama-draft"], dtype="float64")
    for seed in range(3):
        expected = plain.generate("a", constraint=constraint, temperature=0.9, seed=seed, max_new_tokens=20)
        result = default.generate("a", constraint=constraint, temperature=0.9, seed=seed, max_new_tokens=20)
        assert result.text == expected.text and any("forced" in label for label in result.stats.drafters)
    greedy = default.generate("a", constraint=constraint, temperature=0, max_new_tokens=20)
    assert greedy.text == plain.generate("a", constraint=constraint, temperature=0, max_new_tokens=20).text
    assert greedy.text.startswith("abc") and greedy.stats.accepted >= 6


def test_json_under_a_schema_on_the_demo_pair():
    """A real byte-level tokenizer (the demo pair's checkpoints on transformers): the default's JSON is
    constrained plain decoding's, complete, and valid under the schema; its keys were drafted for free."""
    constraint = Constraint.json_schema(SCHEMA)
    plain = specdec.load(backend="transformers", plain=True, dtype="float32")
    default = specdec.load(backend="transformers", dtype="float32")
    for temperature, seed in ((0, None), (0.8, 1), (0.8, 2)):
        expected = plain.generate("def record():\n    return ", constraint=constraint, temperature=temperature,
                                  seed=seed, max_new_tokens=48)
        result = default.generate("def record():\n    return ", constraint=constraint, temperature=temperature,
                                  seed=seed, max_new_tokens=48)
        assert result.text == expected.text and result.finish_reason == "stop", result.text
        assert constraint.check(result.text) and any("forced" in label for label in result.stats.drafters), result.text


def test_a_vocabulary_that_cannot_write_the_constraint_is_refused(eos_dirs):
    """The tiny models' 16 tokens hold no brace: JSON cannot start. Refused when the request is made."""
    decoder = specdec.load(eos_dirs["llama"], plain=True, dtype="float64")
    with pytest.raises(SpecDecError, match="vocabulary") as refused:
        decoder.request("a", constraint=Constraint.json_object(param="response_format"))
    assert refused.value.param == "response_format"


def test_greedy_constrained_speculation_on_llama_cpp(gguf_models):
    """The demo pair on llama.cpp under a schema, a choice and a regular expression: the default and a
    fixed chain write constrained plain decoding's text, which matches."""
    plain = specdec.load(gguf_models["gguf-f16"], plain=True, threads=1)
    decoders = [specdec.load(gguf_models["gguf-f16"], gguf_models["gguf-draft-f16"], threads=1, **options)
                for options in (dict(), dict(gamma=3))]
    for constraint in (Constraint.json_schema(SCHEMA), Constraint.choice(["return None", "return self", "pass"]),
                       Constraint.regex(r"def [a-z_]{1,12}\(self\):")):
        expected = plain.generate("class A:\n    ", constraint=constraint, temperature=0, max_new_tokens=48)
        assert expected.finish_reason == "stop" and constraint.check(expected.text), expected.text
        for decoder in decoders:
            assert decoder.generate("class A:\n    ", constraint=constraint, temperature=0,
                                    max_new_tokens=48).tokens == expected.tokens


STATISTICAL_REGEX = "[a-f]{2}[a-m ]{2,}"  # at least 4 tokens: within 3 no end token is allowed


def exact_constrained_joint(target: specdec.CausalLM, grammars, sampling: SamplingParams, prompt, length=3):
    """P(y1..y3) under constrained plain sampling, by enumeration with no-cache forwards."""
    joint = {(): 1.0}
    for _ in range(length):
        prefixes = list(joint)
        with torch.inference_mode():
            logits = target.model(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1, :target.vocab_size]
        rows = []
        for prefix, row in zip(prefixes, logits):
            matcher = grammars.matcher(Constraint.regex(STATISTICAL_REGEX))
            matcher.advance(prefix)
            rows.append(row.masked_fill(~matcher.allowed(), float("-inf")))
        probs = probs_from_logits(torch.stack(rows), sampling)
        joint = {p + (t,): joint[p] * float(probs[i, t]) for i, p in enumerate(prefixes)
                 for t in range(target.vocab_size) if probs[i, t] > 0}
    return joint


@pytest.mark.statistical
@pytest.mark.parametrize("drafter", ["draft-model", "auto"])
def test_constrained_sampling_follows_the_constrained_target(eos_dirs, drafter):
    """The first 3 tokens under a regular expression, sampled at T 1: their joint is constrained plain
    sampling's (chi-square); the draft model's drawn chains propose tokens the grammar forbids."""
    target = specdec.load_model(eos_dirs["llama"], device="cpu", dtype="float64")
    draft = ModelDrafter(specdec.load_model(eos_dirs["qwen2-draft"], device="cpu", dtype="float64"))
    auto = specdec.AutoDrafter(draft, specdec.PromptLookupDrafter())
    decoder = (specdec.SpeculativeDecoder(target, draft, gamma=2) if drafter == "draft-model"
               else specdec.SpeculativeDecoder(target, auto, gamma="auto"))
    prompt, constraint = [1, 2, 3, 1, 2, 3, 1, 2], Constraint.regex(STATISTICAL_REGEX)
    counts, drafted, accepted, seed = Counter(), 0, 0, zlib.crc32(drafter.encode())
    for i in range(SAMPLES):
        result = decoder.generate(prompt, constraint=constraint, temperature=1.0, max_new_tokens=3, seed=seed + i)
        counts[tuple(result.tokens)] += 1
        drafted, accepted = drafted + result.stats.drafted, accepted + result.stats.accepted
    assert 0 < accepted < drafted
    joint = exact_constrained_joint(target, decoder.grammars, SamplingParams(temperature=1.0), prompt)
    pvalue = chi_square_pvalue(counts, joint, SAMPLES)
    assert pvalue > 1e-4, f"p-value {pvalue:.3g}"


@pytest.mark.parametrize("make,param", [
    (lambda: Constraint.json_schema("{not json", param="response_format"), "response_format"),
    (lambda: Constraint.json_schema({"type": "object", "properties": {"a": {"type": "nonsense"}}},
                                    param="response_format"), "response_format"),
    (lambda: Constraint.regex("(unclosed", param="structured_outputs"), "structured_outputs"),
    (lambda: Constraint.grammar("start: undefined_rule", param="structured_outputs"), "structured_outputs"),
    (lambda: Constraint.choice([], param="structured_outputs"), "structured_outputs"),
])
def test_a_bad_constraint_is_refused_by_name(eos_dirs, make, param):
    decoder = specdec.load(eos_dirs["llama"], plain=True, dtype="float64")
    with pytest.raises(SpecDecError) as refused:
        decoder.generate("a", constraint=make(), max_new_tokens=4)
    assert refused.value.param == param


def test_compiled_grammars_are_cached_and_bounded(eos_dirs, monkeypatch):
    import specdec.constraints as constraints_module

    monkeypatch.setattr(constraints_module, "CACHED_GRAMMARS", 2)
    decoder = specdec.load(eos_dirs["llama"], plain=True, dtype="float64")
    for pattern in ("a+", "b+", "a+", "c+", "d+"):
        decoder.generate("a", constraint=Constraint.regex(pattern), temperature=0, max_new_tokens=3)
    assert list(decoder.grammars._cache) == ["regex\0c+", "regex\0d+"]
    assert json.loads(Constraint.choice(["x", "y"]).text) == ["x", "y"]


def test_a_model_without_an_end_token_is_told_why(model_dirs):
    decoder = specdec.load(model_dirs["llama"], plain=True, dtype="float64")
    with pytest.raises(SpecDecError, match="end token") as refused:
        decoder.generate("a", constraint=Constraint.regex("a+", param="structured_outputs"), max_new_tokens=4)
    assert refused.value.param == "structured_outputs"



# ------------------------------------------------------------------ the server

SERVED = "demo"


@pytest.fixture(scope="module")
def demo_server():
    """The demo pair on transformers (a byte-level tokenizer, an end token, the chat template it ships)."""
    from specdec.server import create_app
    from test_server import LiveServer

    from specdec.config import DEMO_CHAT_TEMPLATE, read_template

    decoder = specdec.load(backend="transformers", dtype="float32")
    decoder.tokenizer.chat_template = read_template(DEMO_CHAT_TEMPLATE)  # as `specdec serve` gives the demo pair
    live = LiveServer(create_app(decoder, SERVED, max_queue=32, depth=None))
    yield live, decoder
    live.stop()


def _post(server, path: str, body: dict):
    import httpx

    return httpx.post(server.url + path, json={"model": SERVED, "max_tokens": 48, "temperature": 0, **body}, timeout=60)


def test_the_server_honours_response_format_and_matches_offline(demo_server):
    server, decoder = demo_server
    messages = [{"role": "user", "content": "Give a record."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}
    reply = _post(server, "/v1/chat/completions", {"messages": messages, "response_format": response_format}).json()
    text = reply["choices"][0]["message"]["content"]
    assert Constraint.json_schema(SCHEMA).check(text) and reply["choices"][0]["finish_reason"] == "stop", text
    offline = decoder.generate(decoder.chat_ids(messages), constraint=Constraint.json_schema(SCHEMA), temperature=0,
                               max_new_tokens=48)
    assert text == offline.text
    any_object = _post(server, "/v1/chat/completions", {"messages": messages, "temperature": 0.8, "seed": 3,
                                                        "response_format": {"type": "json_object"}}).json()
    assert isinstance(json.loads(any_object["choices"][0]["message"]["content"]), dict)


@pytest.mark.parametrize("fields,check", [
    ({"structured_outputs": {"regex": r"def [a-z_]{1,10}\(\):"}}, Constraint.regex(r"def [a-z_]{1,10}\(\):")),
    ({"structured_outputs": {"choice": ["pass", "return None"]}}, Constraint.choice(["pass", "return None"])),
    ({"structured_outputs": {"json": SCHEMA}}, Constraint.json_schema(SCHEMA)),
    ({"guided_json": SCHEMA}, Constraint.json_schema(SCHEMA)),
    ({"json_schema": SCHEMA}, Constraint.json_schema(SCHEMA)),
    ({"guided_choice": ["yes", "no"]}, Constraint.choice(["yes", "no"])),
], ids=["regex", "choice", "json", "guided_json", "llama-server json_schema", "guided_choice"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_honour_every_structured_output_field(demo_server, fields, check, stream):
    from test_server import sse_events

    server, _ = demo_server
    response = _post(server, "/v1/completions", {"prompt": "class A:\n    ", "stream": stream, **fields})
    assert response.status_code == 200, response.text
    if stream:
        events = [event for event in sse_events(response) if event != "[DONE]"]
        text = "".join(event["choices"][0]["text"] for event in events)
    else:
        text = response.json()["choices"][0]["text"]
    assert check.check(text), text


def test_a_gbnf_grammar_is_honoured(demo_server):
    server, _ = demo_server
    grammar = 'root ::= "x = " [0-9]+ ("." [0-9]+)?'
    text = _post(server, "/v1/completions", {"prompt": "def f():\n    ", "grammar": grammar}).json()["choices"][0]["text"]
    import re

    assert re.fullmatch(r"x = [0-9]+(\.[0-9]+)?", text), text


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ({"guided_regex": "a+", "grammar": "root ::= \"a\""}, "grammar"),
    ({"grammar": "root ::= undefined"}, "grammar"),
])
def test_a_bad_structured_output_is_a_400_naming_its_field(demo_server, fields, param):
    server, _ = demo_server
    response = _post(server, "/v1/completions", {"prompt": "a", **fields})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_the_openai_client_gets_parsed_json(demo_server):
    import openai

    server, _ = demo_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    reply = client.chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": "A record, please."}], max_tokens=48, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}})
    assert Constraint.json_schema(SCHEMA).check(reply.choices[0].message.content)


# ------------------------------------------------------------------ the CLI


def test_the_cli_takes_every_kind_of_constraint(eos_dirs, tmp_path, capsys):
    from specdec.cli import main
    from test_cli import cli_json

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "string"}))
    grammar = tmp_path / "g.gbnf"
    grammar.write_text('root ::= "abc" [d-f]+ " " [g-m]+')
    model = ["--target", eos_dirs["llama"], "--draft", eos_dirs["llama-draft"], "--dtype", "float64",
             "--temperature", "0", "--max-new-tokens", "20"]
    regex = cli_json(capsys, "generate", "ab", *model, "--regex", "[a-f]{3}([g-m]{2,4}[a-f]){1,2}")
    assert Constraint.regex("[a-f]{3}([g-m]{2,4}[a-f]){1,2}").check(regex["text"]) and regex["finish_reason"] == "stop"
    choice = cli_json(capsys, "generate", "ab", *model, "--choice", "cab", "--choice", "bad")
    assert choice["text"] in ("cab", "bad")
    gbnf = cli_json(capsys, "generate", "ab", *model, "--grammar", str(grammar))
    assert gbnf["text"].startswith("abc") and " " in gbnf["text"]
    # no token holds a quote: llguidance's mask lets the letters through, and the first one is refused, loudly
    assert main(["generate", "ab", *model, "--json-schema", str(schema)]) == 1
    assert "constraint refused" in capsys.readouterr().err


@pytest.mark.parametrize("flags,named", [(["--regex", "(unclosed"], "regex"), (["--choice", ""], "choice"),
                                         (["--json-schema", "/no/such/file.json"], "JSON Schema file")])
def test_the_cli_refuses_a_bad_constraint_before_loading_a_model(capsys, flags, named):
    from specdec.cli import main

    assert main(["generate", "ab", "--target", "/no/such/model", *flags]) == 1
    assert named in capsys.readouterr().err


def test_sixteen_concurrent_requests_some_constrained(demo_server):
    """8 constrained (4 schemas) and 8 free requests at once in the batch: every one answered (no 5xx),
    each greedy text the one the library writes alone, every constrained one valid."""
    from concurrent.futures import ThreadPoolExecutor

    server, decoder = demo_server
    schemas = [SCHEMA, {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
               {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "integer"},
                                                           "maxItems": 4}}, "required": ["items"]},
               {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}}, "required": ["name"]}]
    bodies = [{"prompt": f"def f{i}():\n    return ", "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": schemas[i % 4]}}} if i % 2 else
              {"prompt": f"def f{i}():\n    return "} for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda body: _post(server, "/v1/completions", body), bodies))
    assert [r.status_code for r in replies] == [200] * 16
    for i, (body, reply) in enumerate(zip(bodies, replies)):
        text = reply.json()["choices"][0]["text"]
        constraint = Constraint.json_schema(schemas[i % 4]) if i % 2 else None
        alone = decoder.generate(body["prompt"], constraint=constraint, temperature=0, max_new_tokens=48)
        assert text == alone.text, i
        assert constraint is None or constraint.check(text), text
