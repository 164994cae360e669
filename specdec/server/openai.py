"""The OpenAI wire format: request bodies (checked), errors, and response objects.

Fields a client relies on are honoured or refused with a 400, never silently ignored: sampling
(temperature, top_p, top_k, min_p, the presence, frequency and repetition penalties, logit_bias, seed,
stop, stop_token_ids, ignore_eos, max_tokens), logprobs, echo, stream and its usage, structured outputs
(OpenAI's `response_format`, vLLM's `structured_outputs` and `guided_*`, llama-server's `grammar` and
`json_schema`), n choices, tools (calls in OpenAI's shape, `tool_choice` "required" or a named function made
a constraint); what we do not implement (best_of > 1, suffix, the deprecated `functions`) is refused by name.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from specdec.api import GenerationResult, SpeculativeDecoder
from specdec.constraints import Constraint
from specdec.engine import TokenLogprob
from specdec.errors import SpecDecError
from specdec.params import Limits, SamplingParams
from specdec.tools import ToolCall, ToolFormat, ToolUse, tool_choice_from, tools_from
from specdec.types import GenerationStats


MAX_CHOICES = 16  # n: a request's choices are rows of the batch, each its own generation


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


ERROR_RESPONSES = {
    400: {"model": ErrorBody, "description": "The request is malformed or asks for something not supported"},
    401: {"model": ErrorBody, "description": "The API key is missing or wrong (only when the server has one)"},
    404: {"model": ErrorBody, "description": "No such model"},
    408: {"model": ErrorBody, "description": "The request body did not arrive in time"},
    411: {"model": ErrorBody, "description": "A POST body needs a Content-Length header"},
    413: {"model": ErrorBody, "description": "The request body is too large"},
    429: {"model": ErrorBody, "description": "The queue is full; retry after the Retry-After header's seconds"},
    503: {"model": ErrorBody, "description": "The server is shutting down"},
}


def error_response(message: str, status: int, code: str | None = None, param: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    kind = ("rate_limit_error" if status == 429 else "authentication_error" if status == 401
            else "server_error" if status >= 500 else "invalid_request_error")
    if status in (429, 503):
        headers = {"Retry-After": "1", **(headers or {})}
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


# ---------------------------------------------------------------------------- request bodies


# OpenAI's types, not coerced: `true` is no max_tokens, "yes" no stream
STRICT = ConfigDict(extra="ignore", strict=True)
MAX_TOP_K = 2**31 - 1


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


def text_of(content: str | list[TextPart]) -> str:
    """A content field's text: the string, or its parts' texts joined. It also reads a body not yet
    checked (the Ray ingress routes by it): there a part is a dict, and whatever is not text adds nothing."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    texts = (part.text if isinstance(part, TextPart) else part.get("text") if isinstance(part, dict) else None
             for part in content)
    return "".join(text for text in texts if isinstance(text, str))


class PredictionContent(BaseModel):
    """OpenAI's Predicted Outputs: text the reply is expected to be, e.g. a file after an edit."""

    model_config = STRICT

    type: Literal["content"]
    content: str | list[TextPart]


class SamplingFields(BaseModel):
    """What both endpoints accept; top_k is an extension (above the vocabulary's size it limits
    nothing). `user` names the tenant whose history of earlier requests drafts for this one (a
    `History`), within the request's scope; `cache_salt` (as vLLM has it) narrows the scope: kept
    caches and histories are shared only by requests with the same API key and salt. Other
    unknown fields are ignored. Types are strict, as in OpenAI's schema:
    an integer is a valid float, nothing else is coerced."""

    model_config = STRICT

    model: str
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(1.0, ge=0, le=2)
    top_p: float | None = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(0, ge=0, le=MAX_TOP_K)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    n: int | None = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    prediction: PredictionContent | None = None
    # structured outputs: one of these (see `constraint`)
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    grammar: str | None = None
    json_schema: dict | None = None
    # vLLM's and llama-server's sampling fields
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    user: str | None = Field(None, max_length=256)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)

    def predicted_text(self) -> str | None:
        """The prediction's text ('' when it is empty: it drafts nothing, but a server that cannot
        draft from one still refuses it); None without one."""
        return text_of(self.prediction.content) if self.prediction is not None else None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling(self) -> SamplingParams:
        """Checked where the request is made (a SpecDecError names a bad field)."""
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed,
                              min_p=self.min_p or 0.0, presence_penalty=self.presence_penalty or 0.0,
                              frequency_penalty=self.frequency_penalty or 0.0,
                              repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                              logit_bias=_token_biases(self.logit_bias or {}))

    def limits(self) -> Limits:
        return Limits(max_new_tokens=self.max_tokens, stop=tuple(self.stops()), logprobs=self.top_logprobs_wanted(),
                      stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=bool(self.ignore_eos))

    @model_validator(mode="after")
    def _defaults_for_nulls(self):
        """Some clients send an explicit null for "use the default"."""
        for name, default in (("temperature", 1.0), ("top_p", 1.0), ("top_k", 0), ("n", 1), ("stream", False)):
            if getattr(self, name) is None:
                setattr(self, name, default)
        return self

    def refuse_unsupported(self) -> None:
        """Options that would change the output distribution, or that are not implemented."""
        self.constraint()  # a malformed one is refused before the request waits
        stop = self.stops()
        if any(not s for s in stop) or len(stop) > 4:
            raise BadRequest("stop must be up to 4 non-empty strings", param="stop")

    def top_logprobs_wanted(self) -> int | None:
        """How many alternatives per token to report; None: no logprobs."""
        return None

    def constraint(self) -> Constraint | None:
        """What the output must match, from whichever field carries it (at most one may)."""
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None
                 and not (name == "response_format" and self.response_format.get("type") == "text")]
        if len(given) > 1:
            raise BadRequest(f"give one structured-output field, not {' and '.join(given)}", param=given[1])
        if not given:
            return None
        name = given[0]
        try:
            return CONSTRAINT_FIELDS[name](getattr(self, name), name)
        except SpecDecError as error:
            raise BadRequest(str(error), param=name) from None


def _token_biases(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias: token ids as JSON keys (text)."""
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise BadRequest("logit_bias maps token ids to values in [-100, 100]", param="logit_bias") from None


def _response_format(value: dict, param: str) -> Constraint:
    """OpenAI's: {"type": "json_object"}, or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    ({"type": "text"} is no constraint: `SamplingFields.constraint` passes it by)."""
    kind = value.get("type")
    if kind == "json_object":
        return Constraint.json_object(param)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise BadRequest("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                             param=param)
        return Constraint.json_schema(spec.get("schema", {}), param)  # strict or not, the schema is kept
    raise BadRequest(f"response_format type {kind!r} is not one of text, json_object, json_schema", param=param)


STRUCTURED_OUTPUTS = {  # vLLM's structured_outputs keys
    "json": lambda value, param: (Constraint.json_schema(value, param) if isinstance(value, (dict, str))
                                  else _refuse("json is a JSON Schema (an object or its text)", param)),
    "json_object": lambda value, param: Constraint.json_object(param) if value is True else _refuse(
        "json_object is true or absent", param),
    "regex": lambda value, param: Constraint.regex(_text(value, param), param),
    "choice": lambda value, param: Constraint.choice(value if isinstance(value, list) else [], param),
    "grammar": lambda value, param: Constraint.grammar(_text(value, param), param),
}


def _structured_outputs(value: dict, param: str) -> Constraint:
    given = [key for key, field in value.items() if field not in (None, False)]
    if len(given) != 1 or given[0] not in STRUCTURED_OUTPUTS:
        raise BadRequest(f"structured_outputs takes exactly one of {', '.join(STRUCTURED_OUTPUTS)}; got "
                         f"{', '.join(given) or 'none'}", param=param)
    return STRUCTURED_OUTPUTS[given[0]](value[given[0]], param)


def _text(value, param: str) -> str:
    return value if isinstance(value, str) else _refuse("it is text", param)


def _refuse(why: str, param: str):
    raise BadRequest(f"{param}: {why}", param=param)


# each structured-output field and how it becomes a Constraint
CONSTRAINT_FIELDS = {
    "response_format": _response_format,
    "structured_outputs": _structured_outputs,
    "guided_json": STRUCTURED_OUTPUTS["json"],
    "guided_regex": Constraint.regex,
    "guided_choice": Constraint.choice,
    "guided_grammar": Constraint.grammar,
    "grammar": Constraint.grammar,  # llama-server's GBNF
    "json_schema": Constraint.json_schema,  # llama-server's
}


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] = Field(description="text, a list of token ids, or a list holding one text")
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.best_of not in (None, 1):
            raise BadRequest("only best_of = 1 is supported", param="best_of")
        if self.suffix:
            raise BadRequest("suffix (insertion) is not supported", param="suffix")
        if self.echo and self.logprobs is not None:
            raise BadRequest("echo with logprobs would need the prompt's log-probabilities, which are not computed",
                             param="echo")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            raise BadRequest("one prompt per request: send a list of prompts as separate requests", param="prompt")

    def prompt_input(self) -> str | list[int]:
        one_text = isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str)
        return self.prompt[0] if one_text else self.prompt

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs


class CalledFunction(BaseModel):
    model_config = STRICT

    name: str
    arguments: str  # JSON text, as the server wrote it


class CalledTool(BaseModel):
    """A call an assistant message made (sent back with the conversation)."""

    model_config = STRICT

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction

    def for_template(self) -> dict:
        """As chat templates read a call: its arguments an object (templates write them with `tojson`)."""
        try:
            arguments = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            raise BadRequest(f"the arguments of tool call {self.id!r} are not JSON", param="messages") from None
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


class Message(BaseModel):
    """What every chat message has; each role's own fields are in its class (`ChatMessage`)."""

    model_config = STRICT

    name: str | None = None

    def for_template(self) -> dict:
        """The message as chat templates know it: text content; `developer` is the system role; an
        assistant's calls with their arguments as objects; a tool's answer with the call's id."""
        role = "system" if self.role == "developer" else self.role
        message = {"role": role, "content": text_of(self.content or "")}
        if getattr(self, "tool_calls", None):
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        for field in ("tool_call_id", "name"):
            if getattr(self, field, None) is not None:
                message[field] = getattr(self, field)
        return message


class TurnMessage(Message):
    role: Literal["system", "developer", "user"]
    content: str | list[TextPart]


class AssistantMessage(Message):
    role: Literal["assistant"]
    content: str | list[TextPart] | None = None  # none when it only called tools
    tool_calls: list[CalledTool] | None = None

    @model_validator(mode="after")
    def _says_or_calls(self):
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant's message has content, tool_calls or both")
        return self


class ToolMessage(Message):
    role: Literal["tool"]
    content: str | list[TextPart]
    tool_call_id: str  # the call it answers


ChatMessage = Annotated[TurnMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class FunctionSpec(BaseModel):
    model_config = STRICT

    name: str
    description: str | None = None
    parameters: dict | None = None  # the arguments' JSON Schema


class ToolSpec(BaseModel):
    """A function the model may call (OpenAI's `tools` entries)."""

    model_config = STRICT

    type: Literal["function"]
    function: FunctionSpec


class FunctionName(BaseModel):
    model_config = STRICT

    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionName


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    functions: list | None = None
    _tool_format: ToolFormat | None = PrivateAttr(None)

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.functions:
            raise BadRequest("functions (the deprecated form of function calling) is not supported: send tools",
                             param="functions")
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")

    def use_tools(self, format: ToolFormat | None) -> None:
        """Tell the request how its model writes calls, before `tool_use` or `constraint` are read."""
        self._tool_format = format

    def tool_use(self) -> ToolUse | None:
        """The request's tools and choice, checked (None: it offers none)."""
        if not self.tools:
            if self.tool_choice is not None and self.tool_choice != "none":
                raise BadRequest("tool_choice needs tools", param="tool_choice")
            return None
        if self._tool_format is None:
            raise BadRequest("this model's chat template does not render tools: the server needs one that does "
                             "(`specdec serve --chat-template FILE`)", param="tools")
        try:
            tools = tools_from([tool.model_dump(exclude_none=True) for tool in self.tools])
            choice = tool_choice_from(self.tool_choice.model_dump() if isinstance(self.tool_choice, BaseModel)
                                      else self.tool_choice, tools)
            return ToolUse(tools, self._tool_format, choice, self.parallel_tool_calls is not False)
        except SpecDecError as error:
            raise BadRequest(str(error), param=error.param) from None

    def constraint(self) -> Constraint | None:
        """A structured output, or the calls `tool_choice` "required" or a named function asks for."""
        tools, given = self.tool_use(), super().constraint()
        forced = tools.constraint() if tools is not None else None
        if forced is not None and given is not None:
            raise BadRequest(f"tool_choice {tools.choice!r} makes the answer a tool call: it cannot also follow "
                             f"{given.param}", param=given.param)
        if tools is not None and tools.choice == "auto" and given is not None:
            raise BadRequest(f"with tools, {given.param} constrains the answer only when tool_choice is 'none'",
                             param=given.param)
        return forced or given

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def chat_prompt(decoder: SpeculativeDecoder, body: ChatRequest) -> list[int]:
    tools = body.tool_use()
    return decoder.chat_ids([m.for_template() for m in body.messages],
                            tools=tools.for_template() if tools is not None else None)


# ---------------------------------------------------------------------------- responses


class Reply:
    """OpenAI response objects for one request: whole, or as stream chunks. `echo`: text to put
    before the completion (the prompt, for completions with echo)."""

    def __init__(self, kind: str, model: str, prompt_tokens: int, tokenizer, echo: str = "",
                 tools: ToolUse | None = None):
        self.kind, self.model, self.prompt_tokens = kind, model, prompt_tokens
        self.tokenizer, self.echo = tokenizer, echo
        self.tools = tools if tools is not None and tools.reads_calls else None  # calls are read from the answers
        self.id = ("chatcmpl-" if kind.startswith("chat") else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}  # per choice: its characters before its next logprobs entry (by pieces)
        self._texts: dict[int, str] = {}  # with tools, per choice: its text so far, and how much of it was sent
        self._sent: dict[int, int] = {}

    @property
    def chat(self) -> bool:
        return self.kind.startswith("chat")

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, results: list[GenerationResult]) -> dict:
        """The whole response: one choice per result, in order."""
        choices = []
        for index, result in enumerate(results):
            logprobs = self._logprobs(result.logprobs, index) if result.logprobs is not None else None
            if self.chat:
                message, finish_reason = self._answer(result.text, result.finish_reason)
                content = {"message": message}
            else:
                content, finish_reason = {"text": self.echo + result.text}, result.finish_reason
            choices.append({"index": index, **content, "logprobs": logprobs, "finish_reason": finish_reason})
        return {**self._head(self.kind), "choices": choices, "usage": self._usage(results),
                "speculative": _speculative([r.stats for r in results])}

    def chunk(self, text: str, finish_reason: str | None, logprobs: list[TokenLogprob] | None = None,
              first: bool = False, index: int = 0) -> dict | None:
        """A stream chunk of choice `index`; `logprobs`: those of its tokens committed since its last chunk."""
        new = self._logprobs(logprobs, index) if logprobs is not None else None
        if self.chat:
            if first:
                delta = {"role": "assistant", "content": ""}
            elif self.tools is not None:
                delta, finish_reason = self._tool_delta(text, finish_reason, index)
            else:
                delta = {"content": text} if text else {}
            choice = {"index": index, "delta": delta, "logprobs": new, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        if first:
            if not self.echo:
                return None
            text = self.echo
        return {**self._head("text_completion"),
                "choices": [{"index": index, "text": text, "logprobs": new, "finish_reason": finish_reason}]}

    def _answer(self, text: str, finish_reason: str) -> tuple[dict, str]:
        """A chat answer's message and finish reason; with tools, the calls read out of its text."""
        content, calls = self.tools.parse(text) if self.tools is not None else (text, [])
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        return ({"role": "assistant", "content": content.strip() or None, "tool_calls": _tool_calls(calls)},
                "tool_calls" if finish_reason == "stop" else finish_reason)

    def _tool_delta(self, text: str, finish_reason: str | None, index: int) -> tuple[dict, str | None]:
        """A streamed answer's delta when calls may be in it: content is sent up to where a call may begin
        (`ToolFormat.held_from`); the rest waits for the end, which sends it, or the calls read from it."""
        seen = self._texts[index] = self._texts.get(index, "") + text
        sent = self._sent.get(index, 0)
        if finish_reason is None:
            self._sent[index] = release = max(sent, self.tools.format.held_from(seen))
            return ({"content": seen[sent:release]} if release > sent else {}), None
        content, calls = self.tools.parse(seen)
        delta = {"content": content[sent:]} if content[sent:] else {}
        if calls:
            return ({**delta, "tool_calls": [{"index": i, **call} for i, call in enumerate(_tool_calls(calls))]},
                    "tool_calls" if finish_reason == "stop" else finish_reason)
        return delta, finish_reason

    def usage_chunk(self, results: list[GenerationResult]) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [], "usage": self._usage(results),
                "speculative": _speculative([r.stats for r in results])}

    def _usage(self, results: list[GenerationResult]) -> dict:
        """Token counts (the prompt once, every choice's completion); with a prediction, its tokens that
        appeared in the completions and those that did not."""
        completion = sum(len(result.tokens) for result in results)
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                 "total_tokens": self.prompt_tokens + completion,
                 "prompt_tokens_details": {"cached_tokens": results[0].stats.cached_tokens}}
        predicted = [result.prediction_usage() for result in results]
        if predicted[0] is not None:
            usage["completion_tokens_details"] = {"accepted_prediction_tokens": sum(p[0] for p in predicted),
                                                  "rejected_prediction_tokens": sum(p[1] for p in predicted)}
        return usage

    def _logprobs(self, entries: list[TokenLogprob], index: int = 0) -> dict:
        """The chat shape (content: one entry per token) or the legacy completions shape."""
        piece = lambda token: self.tokenizer.decode([token], skip_special_tokens=False)
        if self.chat:
            def entry(token: int, logprob: float) -> dict:
                text = piece(token)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

            return {"content": [{**entry(e.token, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]}
                                for e in entries]}
        tokens = [piece(e.token) for e in entries]
        offsets, at = [], len(self.echo) + self._offsets.get(index, 0)
        for token in tokens:
            offsets.append(at)
            at += len(token)
        self._offsets[index] = at - len(self.echo)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "text_offset": offsets,
                "top_logprobs": ([{piece(t): lp for t, lp in e.top} for e in entries]
                                 if any(e.top for e in entries) else None)}


def _tool_calls(calls: list[ToolCall]) -> list[dict]:
    return [{"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in calls]


def _speculative(stats: list[GenerationStats]) -> dict:
    """The extension field: how the speculation went for this request (all its choices together)."""
    total = lambda name: sum(getattr(s, name) for s in stats)
    drafted, forwards = total("drafted"), total("target_forwards")
    return {
        "acceptance_rate": total("accepted") / drafted if drafted else None,
        "tokens_per_target_forward": total("generated_tokens") / forwards if forwards else None,
        "target_forwards": forwards,
        "draft_forwards": total("draft_forwards"),
        "drafted": drafted,
        "accepted": total("accepted"),
    }
