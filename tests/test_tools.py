"""Tool calls (`specdec.tools`): each format's calls read out of text and held back from a stream while one
may be starting; `tool_choice` "required" or a named function made a constraint whose output every
format's parser reads back, equal to plain decoding under the same constraint on both backends; the
server's answers in OpenAI's shape, streamed and not, read by the openai client; bad tools refused by name."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

import specdec
from specdec.errors import SpecDecError
from specdec.server.openai import Reply
from specdec.tools import FORMATS, ToolUse, format_of, tool_choice_from, tools_from

# a Hermes-style template, as Qwen's declares tools: each as JSON in the system turn, calls in <tool_call> tags
TOOL_TEMPLATE = """{%- if tools %}<|system|>You may call these functions:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}Call one as <tool_call>
{"name": ..., "arguments": ...}
</tool_call>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>{% for c in m.tool_calls %}<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>{% endfor %}
{% else %}<|{{ m.role }}|>{{ m.content }}
{% endif %}
{%- endfor %}<|assistant|>"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                                                 "maximum": 14}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def valid_calls(calls) -> bool:
    """Each call names an offered function and its arguments are JSON its schema accepts."""
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return bool(calls)


# ---------------------------------------------------------------------------- formats


@pytest.mark.parametrize("format,text,content,calls", [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>',
     "Sure.\n", [("get_time", {"zone": 1})]),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>\n<tool_call>\n'
     '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>', "\n",
     [("get_time", {"zone": 1}), ("get_weather", {"city": "Oslo", "unit": "celsius"})]),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}', "", [("get_time", {"zone": 1})]),
    ("hermes", "<tool_call>\n{not json}\n</tool_call>", None, []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "</tool_call> <tool_call>"}}'
     '\n</tool_call>. ', ". ", [("get_weather", {"city": "</tool_call> <tool_call>"})]),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}} trailing\n</tool_call>', None, []),
    ("hermes", "no call here", None, []),
    ("llama3", '<|python_tag|>{"name": "get_time", "parameters": {"zone": -3}}', "", [("get_time", {"zone": -3})]),
    ("llama3", ' {"name": "get_time", "parameters": {"zone": 2}}; {"name": "get_time", "parameters": {"zone": 3}}',
     "", [("get_time", {"zone": 2}), ("get_time", {"zone": 3})]),
    ("llama3", 'The answer is {"name": "get_time"}', None, []),
    ("mistral", 'Let me look. [TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": 5}}]', "Let me look. ",
     [("get_time", {"zone": 5})]),
    ("mistral", ' [{"name": "get_time", "arguments": "{\\"zone\\": 5}"}]', "", [("get_time", {"zone": 5})]),
    ("mistral", "[TOOL_CALLS] [1, 2]", None, []),
])
def test_each_format_reads_its_calls_and_leaves_the_rest_as_content(format, text, content, calls):
    got_content, got_calls = FORMATS[format].parse(text)
    assert got_content == (text if content is None else content)
    assert [(call.name, json.loads(call.arguments)) for call in got_calls] == calls
    assert len({call.id for call in got_calls}) == len(got_calls) and all(call.id for call in got_calls)


def test_calls_to_functions_not_offered_are_content():
    use = ToolUse(tools_from([TIME]), FORMATS["hermes"])
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert use.parse(text) == (text, [])
    assert ToolUse(tools_from([TIME]), FORMATS["hermes"], "none").parse(text.replace("weather", "time")) == (
        text.replace("weather", "time"), [])


@pytest.mark.parametrize("format,text,held", [
    ("hermes", "Sure, let me", 12), ("hermes", "Sure <tool", 5), ("hermes", "Sure <b>", 8),
    ("hermes", "a<tool_call>\n{", 1), ("mistral", "ok [TOOL_", 3), ("mistral", "ok [1]", 6),
    ("llama3", "  ", 0), ("llama3", ' {"name"', 0), ("llama3", "<|pyth", 0), ("llama3", "Paris is", 8),
])
def test_a_stream_holds_back_only_what_may_begin_a_call(format, text, held):
    assert FORMATS[format].held_from(text) == held


@pytest.mark.parametrize("template,format", [
    (TOOL_TEMPLATE, "hermes"),
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", "mistral"),
    ("<|start_header_id|>system<|end_header_id|>{% for t in tools %}{{ t|tojson }}{% endfor %}", "llama3"),
    ("{% for t in tools %}{{ t.function.name }}{% endfor %}{{ messages[0].content }}", "hermes"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
    (None, None),
])
def test_the_format_is_read_from_the_chat_template(template, format):
    found = format_of(template)
    assert (found.name if found else None) == format


@pytest.mark.parametrize("tools,choice,match", [
    ([], None, "non-empty list"),
    ([{"type": "function"}], None, r"tools\[0\]"),
    ([{"type": "function", "function": {"name": "has space"}}], None, "letters, digits"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, "JSON Schema"),
    ([TIME, TIME], None, "same name"),
    ([TIME], {"type": "function", "function": {"name": "get_weather"}}, "get_weather"),
    ([TIME], "sometimes", "tool_choice"),
    ([TIME], {"type": "function"}, "names a function"),
])
def test_bad_tools_and_tool_choices_are_refused_by_name(tools, choice, match):
    with pytest.raises(SpecDecError, match=match) as refused:
        offered = tools_from(tools)
        ToolUse(offered, FORMATS["hermes"], tool_choice_from(choice, offered))
    assert refused.value.param in ("tools", "tool_choice")


# ---------------------------------------------------------------------------- generation


@pytest.fixture(scope="module")
def demo_decoders():
    """The demo pair on transformers (a byte-level tokenizer with an end token), taught tools by TOOL_TEMPLATE:
    plain decoding, the default and a fixed chain of the draft model."""
    decoders = [specdec.load(backend="transformers", dtype="float32", **options)
                for options in (dict(plain=True), dict(), dict(gamma=3))]
    for decoder in decoders:
        decoder.tokenizer.chat_template = TOOL_TEMPLATE
    return decoders


@pytest.mark.parametrize("format,choice", [(format, "required") for format in FORMATS] + [("hermes", "get_weather")])
def test_a_required_call_is_plain_decodings_and_its_format_reads_it_back(demo_decoders, format, choice):
    """Under each format's grammar the default (greedy and seeded: a seed keys its draws by position) and a
    chain (greedy) write plain decoding's tokens, and the format's parser reads valid calls to the offered
    functions out of them. (One call: with parallel calls allowed, the demo pair's code model calls again
    and again.)"""
    plain, *speculative = demo_decoders
    use = ToolUse(tools_from(TOOLS), FORMATS[format], choice, parallel=False)
    prompt = plain.chat_ids(MESSAGES, tools=use.for_template())
    for temperature, seed in ((0, None), (0.8, 4)):
        expected = plain.generate(prompt, constraint=use.constraint(), temperature=temperature, seed=seed,
                                  max_new_tokens=64)
        assert expected.finish_reason == "stop", expected.text
        content, calls = use.parse(expected.text)
        assert valid_calls(calls) and not content.strip(), expected.text
        assert choice == "required" or {call.name for call in calls} == {choice}
        for decoder in speculative[:1] if seed is not None else speculative:
            assert decoder.generate(prompt, constraint=use.constraint(), temperature=temperature, seed=seed,
                                    max_new_tokens=64).tokens == expected.tokens


@pytest.mark.parametrize("format,calls", [
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>\n<tool_call>\n'
               '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'),
    ("mistral", '[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": 1}}, '
                '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]'),
])
def test_parallel_calls_are_allowed_only_when_asked(demo_decoders, format, calls):
    """Two calls in a format's own layout are the whole of what its grammar accepts with parallel calls;
    without, the grammar refuses the second; invalid arguments are refused either way."""
    plain = demo_decoders[0]

    def accepts(text: str, parallel: bool) -> bool:
        matcher = plain.grammars.matcher(ToolUse(tools_from(TOOLS), FORMATS[format], "required", parallel).constraint())
        tokens = plain.tokenizer.encode(text, add_special_tokens=False) + [plain.tokenizer.eos_token_id]
        return matcher._matcher.validate_tokens(tokens) == len(tokens)

    assert accepts(calls, parallel=True) and not accepts(calls, parallel=False)
    assert not accepts(calls.replace('"zone": 1', '"zone": 99'), parallel=True)


def test_a_tool_whose_schema_refers_to_its_definitions_is_called_validly(demo_decoders):
    """Schemas as pydantic writes them: `$ref` into `$defs` still resolves inside the call's grammar."""
    plain = demo_decoders[0]
    point = {"type": "function", "function": {"name": "move", "parameters": {
        "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                            "required": ["x", "y"], "additionalProperties": False}},
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Point"}}, "required": ["to"],
        "additionalProperties": False}}}
    use = ToolUse(tools_from([point]), FORMATS["hermes"], "required", parallel=False)
    matcher = plain.grammars.matcher(use.constraint())
    good = '<tool_call>\n{"name": "move", "arguments": {"to": {"x": 1, "y": 2}}}\n</tool_call>'
    for text, accepted in ((good, True), (good.replace('"y": 2', '"y": "2"'), False)):
        tokens = plain.tokenizer.encode(text, add_special_tokens=False) + [plain.tokenizer.eos_token_id]
        assert (matcher._matcher.deep_copy().validate_tokens(tokens) == len(tokens)) is accepted, text


def test_a_gguf_template_renders_tools_as_transformers_does_and_llama_cpp_calls_losslessly(gguf_models,
                                                                                          demo_decoders):
    """llama.cpp's tokenizer renders the template with transformers' `tojson`, and a required call on
    llama.cpp is plain decoding's there too."""
    plain = specdec.load(gguf_models["gguf-f16"], plain=True, threads=1)
    default = specdec.load(gguf_models["gguf-f16"], gguf_models["gguf-draft-f16"], threads=1)
    for decoder in (plain, default):
        decoder.tokenizer.chat_template = TOOL_TEMPLATE
    use = ToolUse(tools_from(TOOLS), FORMATS["hermes"], "required")
    conversation = MESSAGES + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": {"zone": 1}}}]},
        {"role": "tool", "content": "12:00", "tool_call_id": "call_1"}]
    rendered = plain.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False,
                                                   tools=use.for_template())
    assert rendered == demo_decoders[0].tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=False, tools=use.for_template())
    assert '"get_weather"' in rendered and '{"name": "get_time", "arguments": {"zone": 1}}' in rendered
    prompt = plain.chat_ids(MESSAGES, tools=use.for_template())
    expected = plain.generate(prompt, constraint=use.constraint(), temperature=0, max_new_tokens=64)
    assert valid_calls(use.parse(expected.text)[1]), expected.text
    assert default.generate(prompt, constraint=use.constraint(), temperature=0, max_new_tokens=64).tokens == \
        expected.tokens


def test_a_template_without_tools_is_refused_tools(demo_decoders):
    plain = demo_decoders[0]
    template, plain.tokenizer.chat_template = plain.tokenizer.chat_template, "{{ messages[0].content }}"
    try:
        with pytest.raises(SpecDecError, match="does not render tools") as refused:
            plain.chat_ids(MESSAGES, tools=[WEATHER])
        assert refused.value.param == "tools"
    finally:
        plain.tokenizer.chat_template = template


# ---------------------------------------------------------------------------- the server

SERVED = "demo"


@pytest.fixture(scope="module")
def tool_server(demo_decoders):
    from specdec.server import create_app
    from test_server import LiveServer

    decoder = demo_decoders[1]
    live = LiveServer(create_app(decoder, SERVED, max_queue=32, depth=None))
    yield live, decoder
    live.stop()


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_the_openai_client_reads_required_calls_whole_and_streamed(tool_server, tool_choice):
    server, decoder = tool_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    asked = dict(model=SERVED, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
                 max_tokens=64, temperature=0)
    whole = client.chat.completions.create(**asked)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert call.type == "function" and call.id.startswith("call_")
    assert isinstance(tool_choice, str) or {call.function.name for call in calls} == {"get_time"}
    use = ToolUse(tools_from(TOOLS), decoder.tool_format, tool_choice_from(tool_choice, tools_from(TOOLS)), False)
    offline = decoder.generate(decoder.chat_ids(MESSAGES, tools=use.for_template()), constraint=use.constraint(),
                               temperature=0, max_new_tokens=64)
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.name, c.arguments) for c in use.parse(offline.text)[1]]

    streamed, finish = {}, None
    for chunk in client.chat.completions.create(**asked, stream=True):
        for delta_call in chunk.choices[0].delta.tool_calls or []:
            call = streamed.setdefault(delta_call.index, {"name": "", "arguments": ""})
            call["name"] += delta_call.function.name or ""
            call["arguments"] += delta_call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(streamed.items())] == [
        (c.function.name, c.function.arguments) for c in calls]


def test_a_conversation_with_tool_results_is_rendered_and_auto_answers_as_offline(tool_server):
    """A call sent back with its result; with tool_choice auto the model's answer, call or text, is read
    as offline generation's text reads."""
    server, decoder = tool_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    conversation = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    answer = client.chat.completions.create(model=SERVED, messages=conversation, tools=TOOLS, max_tokens=32,
                                            temperature=0)
    for_template = [dict(m) for m in conversation]
    for_template[1] = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Paris", "unit": "celsius"}}}]}
    use = ToolUse(tools_from(TOOLS), decoder.tool_format)
    prompt = decoder.chat_ids(for_template, tools=use.for_template())
    assert answer.usage.prompt_tokens == len(prompt)
    offline = decoder.generate(prompt, temperature=0, max_new_tokens=32)
    content, calls = use.parse(offline.text)
    assert answer.choices[0].message.content == (content.strip() or None if calls else offline.text)
    assert [c.function.name for c in answer.choices[0].message.tool_calls or []] == [c.name for c in calls]


def test_auto_reads_a_call_out_of_an_answer_streamed_or_whole():
    """The wire format alone, on an answer that opens with text and then calls: a stream sends the text
    as it comes and the call at the end, and its deltas add up to the whole reply."""
    use = ToolUse(tools_from(TOOLS), FORMATS["hermes"])
    text = 'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 2}}\n</tool_call>'

    class Result:
        logprobs = prediction = None
        finish_reason = "stop"

    Result.text = text
    whole = Reply("chat.completion", SERVED, 3, None, tools=use)._answer(text, "stop")
    assert whole[1] == "tool_calls" and whole[0]["content"] == "Let me check."
    reply = Reply("chat.completion", SERVED, 3, None, tools=use)
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
    chunks = [reply.chunk(piece, None)["choices"][0] for piece in pieces] + [reply.chunk("", "stop")["choices"][0]]
    sent = "".join(chunk["delta"].get("content", "") for chunk in chunks)
    assert sent == "Let me check.\n"
    assert all("tool_calls" not in chunk["delta"] for chunk in chunks[:-1])
    last = chunks[-1]
    assert last["finish_reason"] == "tool_calls"
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in last["delta"]["tool_calls"]] == [(0, "get_time", {"zone": 2})]
    plain = Reply("chat.completion", SERVED, 3, None, tools=use)
    text_only = [plain.chunk(piece, None)["choices"][0] for piece in ("Paris is", " sunny <b>.")]
    assert "".join(c["delta"].get("content", "") for c in text_only) == "Paris is sunny <b>."


@pytest.mark.parametrize("fields,param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "assistant", "content": None}]}, None),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, "messages"),
])
def test_bad_tool_requests_are_a_400_naming_the_field(tool_server, fields, param):
    server, _ = tool_server
    body = {"model": SERVED, "messages": MESSAGES, "max_tokens": 8, **fields}
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    assert param is None or reply.json()["error"]["param"].startswith(param)  # a schema's error names the part


def test_tools_on_a_template_that_cannot_show_them_are_a_400(model_dirs):
    from specdec.server import create_app
    from test_server import LiveServer, make_decoder

    live = LiveServer(create_app(make_decoder(model_dirs), "tiny", depth=None))
    try:
        reply = httpx.post(live.url + "/v1/chat/completions", json={
            "model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4}, timeout=30)
    finally:
        live.stop()
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tools"
    assert "does not render tools" in reply.json()["error"]["message"]
