"""Tool calls (function calling): the tools a request offers, the constraint that makes the model call
one, and the calls read back from its text, in the formats chat models are trained to write.

A model writes a call as text its chat template taught it: Hermes and Qwen
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, Llama 3.x a bare
`{"name": ..., "parameters": {...}}` (after `<|python_tag|>`), Mistral `[TOOL_CALLS] [{"name": ...,
"arguments": {...}}]`. `ToolFormat` holds one format's three faces: the grammar of its calls (so that
`tool_choice` "required" or a named function is a `Constraint`, verified losslessly like any other and
its frame drafted for free), the parser that reads calls out of finished text ("auto"), and where a
stream must hold text back because a call may be starting in it.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Sequence

from specdec.constraints import JSON_LAYOUT, Constraint
from specdec.errors import SpecDecError

CHOICES = ("none", "auto", "required")  # tool_choice's words; a function's name is the fourth kind


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does, and its arguments' JSON Schema."""

    name: str
    description: str = ""
    parameters: str = '{"type": "object"}'  # the schema as JSON text (hashable, its keys in order)

    def for_template(self) -> dict:
        """The tool as chat templates take it (OpenAI's shape, the schema as an object)."""
        function = {"name": self.name, "description": self.description, "parameters": json.loads(self.parameters)}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """A call the model wrote: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = ""


def tools_from(value: Sequence, param: str = "tools") -> tuple[Tool, ...]:
    """OpenAI's `tools` list ([{"type": "function", "function": {"name", "description", "parameters"}}]),
    checked: a SpecDecError naming `param` says what is wrong."""
    if not isinstance(value, (list, tuple)) or not value:
        raise SpecDecError("tools is a non-empty list of {'type': 'function', 'function': {...}}", param=param)
    tools = []
    for i, entry in enumerate(value):
        function = entry.get("function") if isinstance(entry, dict) and entry.get("type") == "function" else None
        if not isinstance(function, dict):
            raise SpecDecError(f"tools[{i}] is not {{'type': 'function', 'function': {{...}}}}", param=param)
        name, parameters = function.get("name"), function.get("parameters", {"type": "object"})
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise SpecDecError(f"tools[{i}]: a function's name is 1-64 letters, digits, _ . or -", param=param)
        if not isinstance(parameters, dict):
            raise SpecDecError(f"tools[{i}] ({name}): parameters is a JSON Schema object", param=param)
        tools.append(Tool(name, str(function.get("description") or ""), json.dumps(parameters)))
    names = [tool.name for tool in tools]
    if len(set(names)) != len(names):
        raise SpecDecError("tools: two functions have the same name", param=param)
    return tuple(tools)


# ---------------------------------------------------------------------------- formats


class ToolFormat:
    """One family's way of writing calls. `call_fields`: the JSON keys of a call's name and arguments."""

    name = ""
    call_fields = ("name", "arguments")

    def grammar(self, tools: Sequence[Tool], parallel: bool) -> str:
        """A Lark grammar (llguidance's, with `%json` schemas) of this format's calls to `tools`."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(the text outside calls, the calls written), or (text, []) when it holds no call that reads whole."""
        raise NotImplementedError

    def held_from(self, text: str) -> int:
        """Where in `text`, a stream's text so far, a call may begin: what is before it can be sent as
        content now; what is after is held until the generation ends (len(text): nothing held)."""
        raise NotImplementedError

    def call_id(self) -> str:
        return "call_" + secrets.token_hex(12)

    def _call_rule(self, tools: Sequence[Tool]) -> str:
        """A rule `call`: one JSON object calling one of `tools`, written compactly. A tool's definitions
        (`$defs`, as pydantic writes schemas) move to the call's root, where their `#/$defs/...` point."""
        name, arguments = self.call_fields
        alternatives = []
        for i, tool in enumerate(tools):
            parameters = json.loads(tool.parameters)
            definitions = {key: parameters.pop(key) for key in ("$defs", "definitions") if key in parameters}
            schema = {"type": "object", "properties": {name: {"const": tool.name}, arguments: parameters},
                      "required": [name, arguments], "additionalProperties": False, "x-guidance": JSON_LAYOUT,
                      **definitions}
            alternatives.append(f"call_{i}: %json {json.dumps(schema)}")
        return "call: " + " | ".join(f"call_{i}" for i in range(len(tools))) + "\n" + "\n".join(alternatives)

    def _calls(self, values: list) -> list[ToolCall]:
        """ToolCalls from decoded JSON values; [] unless every one is a call with a name and arguments."""
        name, arguments = self.call_fields
        calls = []
        for value in values:
            if not isinstance(value, dict):
                return []
            args = value.get(arguments, value.get("arguments", value.get("parameters")))
            if not isinstance(value.get(name), str) or not isinstance(args, (dict, str)):
                return []
            if isinstance(args, str) and not isinstance(_json(args), dict):
                return []
            text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            calls.append(ToolCall(value[name], text, self.call_id()))
        return calls


class Hermes(ToolFormat):
    """Hermes, Qwen 2.5/3 and many others: each call a JSON object between <tool_call> tags."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def grammar(self, tools: Sequence[Tool], parallel: bool) -> str:
        block = f"block: {json.dumps(self.OPEN + chr(10))} call {json.dumps(chr(10) + self.CLOSE)}"
        start = 'start: block ("\\n" block)*' if parallel else "start: block"
        return "\n".join((start, block, self._call_rule(tools)))

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """Each block is the tag, one JSON value (read as JSON: a string in it may hold the tags), and the
        closing tag, which the end of the text may stand for."""
        outside, values, at = [], [], 0
        while (start := text.find(self.OPEN, at)) >= 0:
            value, end = _json_at(text, start + len(self.OPEN))
            if value is None:
                return text, []
            end = len(text) - len(text[end:].lstrip())
            closed = text.startswith(self.CLOSE, end)
            if not (closed or end == len(text)):
                return text, []
            outside.append(text[at:start])
            values.append(value)
            at = end + len(self.CLOSE) if closed else end
        calls = self._calls(values)
        return ("".join(outside) + text[at:], calls) if calls else (text, [])

    def held_from(self, text: str) -> int:
        return _marker_start(text, self.OPEN)


class Llama3(ToolFormat):
    """Llama 3.1-3.3: the whole answer one JSON object {"name", "parameters"}, after <|python_tag|> or not."""

    name = "llama3"
    call_fields = ("name", "parameters")
    TAG = "<|python_tag|>"

    def grammar(self, tools: Sequence[Tool], parallel: bool) -> str:
        return "\n".join(("start: call", self._call_rule(tools)))  # the format has one call per answer

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip().removeprefix(self.TAG).strip()
        if not body.startswith("{"):
            return text, []
        whole = _json(body)
        values = [whole] if whole is not None else [_json(part) for part in body.split(";")]
        calls = self._calls(values)
        return ("", calls) if calls else (text, [])

    def held_from(self, text: str) -> int:
        body = text.lstrip()
        may_be_call = not body or body.startswith(("{", self.TAG)) or self.TAG.startswith(body)
        return 0 if may_be_call else len(text)


class Mistral(ToolFormat):
    """Mistral (v3 tokenizers and later templates of that shape): [TOOL_CALLS] then a JSON list of calls."""

    name = "mistral"
    MARKER = "[TOOL_CALLS]"

    def grammar(self, tools: Sequence[Tool], parallel: bool) -> str:
        start = 'start: "[TOOL_CALLS] [" call (", " call)* "]"' if parallel else 'start: "[TOOL_CALLS] [" call "]"'
        return "\n".join((start, self._call_rule(tools)))

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        at = text.find(self.MARKER)
        # the marker is a control token in Mistral's own vocabularies: decoded text may have lost it
        head, body = (text[:at], text[at + len(self.MARKER):]) if at >= 0 else ("", text)
        value = _json(body.strip())
        calls = self._calls(value) if isinstance(value, list) and value else []
        return (head, calls) if calls else (text, [])

    def held_from(self, text: str) -> int:
        return _marker_start(text, self.MARKER)

    def call_id(self) -> str:  # Mistral's templates refuse ids other than 9 letters and digits
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


FORMATS = {format.name: format for format in (Hermes(), Llama3(), Mistral())}


def format_of(template: str | dict | None) -> ToolFormat | None:
    """The format a chat template teaches (None: the template renders no tools). A template that
    renders tools without naming a known format's marker gets Hermes', the most widely trained."""
    text = " ".join(template.values()) if isinstance(template, dict) else template or ""
    if not re.search(r"\btools\b", text):
        return None
    if Mistral.MARKER in text:
        return FORMATS["mistral"]
    if Hermes.OPEN in text:
        return FORMATS["hermes"]
    if Llama3.TAG in text or "<|start_header_id|>" in text:
        return FORMATS["llama3"]
    return FORMATS["hermes"]


# ---------------------------------------------------------------------------- a request's tools


@dataclass(frozen=True)
class ToolUse:
    """A request's tools and what it asks of them. choice: "none" (the tools are shown, no call is
    read), "auto" (calls are read from what the model writes), "required" (the model must call one:
    a constraint), or a function's name (it must call that one)."""

    tools: tuple[Tool, ...]
    format: ToolFormat
    choice: str = "auto"
    parallel: bool = True

    def __post_init__(self):
        names = [tool.name for tool in self.tools]
        if self.choice not in CHOICES and self.choice not in names:
            raise SpecDecError(f"tool_choice {self.choice!r} is none of {', '.join(CHOICES)} or a function of tools "
                               f"({', '.join(names)})", param="tool_choice")

    @property
    def reads_calls(self) -> bool:
        return self.choice != "none"

    def for_template(self) -> list[dict]:
        return [tool.for_template() for tool in self.tools]

    def constraint(self) -> Constraint | None:
        """What "required" or a named function makes of the output: calls in the model's format."""
        if self.choice in ("none", "auto"):
            return None
        tools = self.tools if self.choice == "required" else [t for t in self.tools if t.name == self.choice]
        return Constraint.grammar(self.format.grammar(tools, self.parallel), param="tool_choice")

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of finished text; calls to functions the request did not offer are not calls."""
        content, calls = self.format.parse(text) if self.reads_calls else (text, [])
        offered = {tool.name for tool in self.tools}
        return (content, calls) if all(call.name in offered for call in calls) else (text, [])


def tool_choice_from(value, tools: Sequence[Tool]) -> str:
    """OpenAI's tool_choice: "none", "auto", "required", or {"type": "function", "function": {"name": ...}}."""
    if isinstance(value, dict):
        function = value.get("function") if value.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise SpecDecError("tool_choice names a function as {'type': 'function', 'function': {'name': ...}}",
                               param="tool_choice")
        return name
    if value is None:
        return "auto" if tools else "none"
    if value not in CHOICES:
        raise SpecDecError(f"tool_choice is one of {', '.join(CHOICES)} or names a function", param="tool_choice")
    return value


def _marker_start(text: str, marker: str) -> int:
    """Where `marker` begins in text, or where a suffix of text that could still grow into it begins."""
    at = text.find(marker)
    if at >= 0:
        return at
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return len(text) - length
    return len(text)


def _json_at(text: str, at: int) -> tuple[object, int]:
    """The JSON value that starts at `at` (after whitespace) and where it ends; (None, at) if there is none."""
    start = len(text) - len(text[at:].lstrip())
    try:
        return json.JSONDecoder().raw_decode(text, start)
    except (json.JSONDecodeError, RecursionError):
        return None, at


def _json(text: str):
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
