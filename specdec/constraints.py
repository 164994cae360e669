"""Structured outputs: text that must match a JSON Schema, any JSON object, a regular expression, one of
some strings, or a context-free grammar, kept lossless under speculation.

A constraint turns the target's distribution p at a position into p_c ∝ p · allowed, where `allowed`
is what the grammar lets follow the tokens before it. Speculation verifies every draft node against
p_c read on that node's own path (`Matcher.shape`: the matcher's state advances along each path of
the tree and rolls back after it), so a drafted token the grammar forbids has p_c = 0 and is
rejected with the residual of p_c, exactly as constrained plain decoding would have drawn. Where the
grammar leaves one way on (a schema's keys, its punctuation), those tokens are a point-mass chain
(`Forced`): free to draft, and accepted whenever p_c puts its mass there.

The grammar engine is llguidance (llama.cpp's and vLLM's): it compiles JSON Schemas, regular
expressions, Lark and GBNF grammars lazily against a tokenizer, computes a mask in tens of
microseconds on a 262k-token vocabulary, and rolls back (benchmarks/grammar_engine.py).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from specdec.errors import SpecDecError

if TYPE_CHECKING:
    import torch

KINDS = ("json", "json_schema", "regex", "choice", "grammar")
CACHED_GRAMMARS = 64  # compiled grammars kept per tokenizer, least recently used dropped first
# JSON is written compactly, with a space after each separator: no run of whitespace where the model
# might loop (llguidance's default allows any), and the separators become text the grammar forces
JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


@dataclass(frozen=True)
class Constraint:
    """What the output must match. kind: "json" (any JSON object), "json_schema" (text: the schema
    as JSON), "regex", "choice" (text: a JSON list of strings) or "grammar" (Lark or GBNF text).
    Build one with the class methods; `param` names the request field it came from, for errors."""

    kind: str
    text: str = ""
    param: str | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise SpecDecError(f"no constraint kind {self.kind!r}; the kinds are {', '.join(KINDS)}", param=self.param)
        if self.kind != "json" and not self.text:
            raise SpecDecError(f"a {self.kind} constraint needs its text", param=self.param)

    @classmethod
    def json_object(cls, param: str | None = None) -> Constraint:
        return cls("json", "", param)

    @classmethod
    def json_schema(cls, schema: dict | str, param: str | None = None) -> Constraint:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise SpecDecError(f"the JSON Schema is not JSON: {error}", param=param) from None
        if not isinstance(schema, dict):
            raise SpecDecError("a JSON Schema is a JSON object", param=param)
        return cls("json_schema", json.dumps(schema), param)  # its keys in order: the output writes them so

    @classmethod
    def regex(cls, pattern: str, param: str | None = None) -> Constraint:
        return cls("regex", pattern, param)

    @classmethod
    def choice(cls, options: Sequence[str], param: str | None = None) -> Constraint:
        if isinstance(options, str) or not options or not all(isinstance(o, str) and o for o in options):
            raise SpecDecError("a choice is a list of non-empty strings", param=param)
        return cls("choice", json.dumps(list(options)), param)

    @classmethod
    def grammar(cls, text: str, param: str | None = None) -> Constraint:
        return cls("grammar", text, param)

    def lark(self) -> str:
        """The constraint as llguidance's grammar text; a SpecDecError naming `param` if it is invalid."""
        from llguidance import LLMatcher, grammar_from

        kind, text = self.kind, self.text
        if kind in ("json", "json_schema"):  # compact JSON, as OpenAI's strict mode writes it: more of it forced
            schema = json.loads(text) if kind == "json_schema" else {"type": "object"}
            kind, text = "json_schema", json.dumps({**schema, "x-guidance": JSON_LAYOUT})
        try:
            grammar = grammar_from(kind, text)
            error = LLMatcher.validate_grammar(grammar)  # its syntax, without a tokenizer: milliseconds
        except Exception as raised:  # llguidance raises ValueError and its own errors
            error = str(raised)
        if error:
            raise SpecDecError(f"the {self.kind} constraint is invalid: {_first_line(error)}", param=self.param)
        return grammar

    def check(self, text: str) -> bool:
        """Whether finished text matches (the tests' and the bench's check; a grammar's text is not parsed here)."""
        import re

        if self.kind in ("json", "json_schema"):
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                return False
            return isinstance(value, dict) if self.kind == "json" else _validates(value, json.loads(self.text))
        if self.kind == "regex":
            return re.fullmatch(self.text, text) is not None
        if self.kind == "choice":
            return text in json.loads(self.text)
        raise ValueError("a grammar's output is checked by parsing it with that grammar")


def _validates(value, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


def _stop_reason(matcher) -> str:
    """What stopped an llguidance matcher, in a line: its stop reason and the error's first line."""
    return f"{matcher.stop_reason()}: {_first_line(matcher.get_error())}"


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


class Grammars:
    """Compiled constraints for one model's tokenizer: the llguidance tokenizer (made once: 0.5 s on the
    demo pair's 8k vocabulary, 2.6 s on Gemma 3's 262k) and up to CACHED_GRAMMARS matchers ready to copy.
    Thread-safe: the server checks requests on several threads."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: frozenset[int]):
        self._source, self.vocab_size, self.stop_ids = tokenizer, vocab_size, stop_ids
        self._tokenizer = None
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, constraint: Constraint) -> Matcher:
        """A fresh matcher for one generation; compiled once per constraint text."""
        from llguidance import LLMatcher

        key = f"{constraint.kind}\0{constraint.text}"
        with self._lock:
            prototype = self._cache.get(key)
            if prototype is not None:
                self._cache.move_to_end(key)
        if prototype is None:
            grammar = constraint.lark()
            try:
                tokenizer = self.tokenizer()
            except SpecDecError as error:
                raise SpecDecError(str(error), param=constraint.param) from None
            error = LLMatcher.validate_grammar(grammar, tokenizer)
            if error:
                raise SpecDecError(f"the {constraint.kind} constraint is invalid: {_first_line(error)}",
                                   param=constraint.param)
            prototype = LLMatcher(tokenizer, grammar)
            trial = prototype.deep_copy()
            started = any(trial.compute_bitmask())  # the first mask: a grammar too costly, or one no token starts
            failed = prototype if prototype.is_error() else trial if trial.is_error() else None
            if failed is not None or not started:
                why = _stop_reason(failed) if failed is not None else "no token of it can start the output"
                raise SpecDecError(f"the {constraint.kind} constraint cannot be used with this model's vocabulary: "
                                   f"{why}", param=constraint.param)
            with self._lock:
                self._cache[key] = prototype
                while len(self._cache) > CACHED_GRAMMARS:
                    self._cache.popitem(last=False)
        return Matcher(prototype.deep_copy(), self.vocab_size)

    def tokenizer(self):
        if not self.stop_ids:  # a complete grammar allows only an end token: without one it could not end
            raise SpecDecError("structured outputs need a model with an end token (its tokenizer's eos_token or "
                               "its generation config's eos_token_id); this one has none")
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = _lltokenizer(self._source, self.vocab_size, sorted(self.stop_ids))
            return self._tokenizer


def _lltokenizer(tokenizer, vocab_size: int, eos: list[int]):
    """llguidance's view of a Hugging Face fast tokenizer or of a GGUF file's (through llama.cpp)."""
    from llguidance import LLTokenizer, TokenizerWrapper
    from llguidance.hf import from_tokenizer

    if hasattr(tokenizer, "token_bytes"):  # a GGUF file's, through llama.cpp: its tokens' bytes are exact
        wrapper = _Pieces(tokenizer, tokenizer.token_bytes(), eos[0])
        return LLTokenizer(TokenizerWrapper(wrapper), n_vocab=vocab_size, eos_token=eos)

    try:
        return from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
    except ValueError as error:  # a decoder llguidance does not read: its tokens' own text, where that is exact
        wrapper = _Pieces.of(tokenizer, eos[0])
        if wrapper is None:
            raise SpecDecError(f"structured outputs cannot read this tokenizer: {error}") from None
        return LLTokenizer(TokenizerWrapper(wrapper), n_vocab=vocab_size, eos_token=eos)


class _Pieces:
    """A tokenizer as llguidance's `TokenizerWrapper` takes one: each token's bytes (a special token's
    marked by a leading 0xff) and an encoder. Made only where decoding token by token is exact."""

    def __init__(self, tokenizer, tokens: list[bytes], eos: int):
        self._tokenizer, self.tokens, self.eos_token_id, self.bos_token_id = tokenizer, tokens, eos, None

    @classmethod
    def of(cls, tokenizer, eos: int) -> _Pieces | None:
        special = set(getattr(tokenizer, "all_special_ids", ()))
        pieces = [tokenizer.decode([i], skip_special_tokens=False) for i in range(len(tokenizer))]
        ordinary = [i for i in range(len(pieces)) if i not in special]
        if any(not pieces[i] or "\ufffd" in pieces[i] for i in ordinary):
            return None  # partial characters or empty pieces: their bytes are not the token's own
        if tokenizer.decode(ordinary, skip_special_tokens=False) != "".join(pieces[i] for i in ordinary):
            return None  # decoding joins or changes pieces (leading spaces, byte fallback)
        if any(tokenizer.encode(pieces[i], add_special_tokens=False) != [i] for i in ordinary):
            return None  # a piece does not encode back to its token (one the pre-tokenizer drops or splits)
        tokens = [(b"\xff" if i in special else b"") + piece.encode("utf-8") for i, piece in enumerate(pieces)]
        return cls(tokenizer, tokens, eos)

    def __call__(self, text) -> list[int]:
        text = text.decode("utf-8") if isinstance(text, bytes) else text
        return self._tokenizer.encode(text, add_special_tokens=False)


class Matcher:
    """One generation's place in its constraint: advanced by each step's committed tokens, and
    walked along every path of a draft without moving (`shape`; a `penalties.RowShaper`)."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher, self.vocab_size = matcher, vocab_size

    def allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar allows next."""
        import torch  # (the CLI checks a constraint before torch is imported)

        return torch.from_numpy(self._unpacked([self._bitmask()])[0])

    def shape(self, logits: torch.Tensor, tokens: Sequence[int] = (), parents: Sequence[int] = ()) -> torch.Tensor:
        """The target's logits for a step's rows (the root's, then each draft node's) with what the
        grammar forbids on each row's own path set to -inf; a new tensor. A node the grammar forbids is
        never reached (p_c = 0 at it), so the rows of its subtree are left as they are; so is a row
        where nothing is allowed (a path no output takes: were it accepted, the token drawn after it
        would be refused by `advance`, loudly). tokens and parents: the draft's (a tree; a chain's
        parents are -1, 0, 1, ...). Every row's mask is unpacked and applied at once."""
        import torch

        children: dict[int, list[int]] = {}
        for node, parent in enumerate(parents):
            children.setdefault(int(parent), []).append(node)
        masks = {0: self._bitmask()}
        self._walk(masks, -1, [int(t) for t in tokens], children)
        rows = sorted(masks)
        allowed = self._unpacked([masks[row] for row in rows])
        if not allowed[0].any():  # the committed text: where plain decoding is too, with no way on
            raise SpecDecError("the output cannot go on under its constraint: no token of this model's vocabulary "
                               "continues it")
        keep = np.ones((len(logits), self.vocab_size), dtype=bool)  # rows never reached: as they are
        keep[rows] = allowed | ~allowed.any(axis=1, keepdims=True)
        if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
            out = np.full(tuple(logits.shape), -np.inf, dtype=logits.numpy().dtype)  # 4-8x torch's masked_fill
            np.copyto(out, logits.numpy(), where=keep)
            return torch.from_numpy(out)
        return logits.masked_fill(~torch.from_numpy(keep).to(logits.device), float("-inf"))

    def _walk(self, masks: dict[int, bytes], node: int, tokens: list[int], children: dict[int, list[int]]) -> None:
        """Each reachable node's mask (row 1 + node), depth first from `node`, the matcher rolled back after."""
        for child in children.get(node, ()):
            if self._matcher.validate_tokens([tokens[child]]) != 1:
                continue  # forbidden: never accepted, its subtree never reached
            self._matcher.consume_token(tokens[child])
            masks[1 + child] = self._bitmask()
            self._walk(masks, child, tokens, children)
            self._matcher.rollback(1)

    def _bitmask(self) -> bytes:
        bits = self._matcher.compute_bitmask()
        if self._matcher.is_error():  # its mask means nothing: fail the generation rather than serve it unconstrained
            raise SpecDecError(f"the constraint's grammar engine stopped: {_stop_reason(self._matcher)}")
        return bits

    def _unpacked(self, bitmasks: list[bytes]) -> np.ndarray:
        """[len(bitmasks), vocab] bool; a padded vocabulary's extra rows are never allowed."""
        bits = np.frombuffer(b"".join(bitmasks), dtype=np.uint8).reshape(len(bitmasks), -1)
        allowed = np.unpackbits(bits, axis=1, bitorder="little").view(bool)[:, : self.vocab_size]
        if allowed.shape[1] < self.vocab_size:
            allowed = np.pad(allowed, ((0, 0), (0, self.vocab_size - allowed.shape[1])))
        return allowed

    def advance(self, tokens: Sequence[int]) -> None:
        """Commit a step's tokens (each allowed: they were drawn from p_c)."""
        for token in tokens:
            if self._matcher.is_stopped():
                return  # the end token that follows a complete grammar
            if not self._matcher.consume_token(int(token)):  # never, for a token drawn from a masked row
                raise SpecDecError(f"the constraint refused committed token {token}: {_stop_reason(self._matcher)}")

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (none where it leaves a choice)."""
        return list(self._matcher.compute_ff_tokens())


class Forced:
    """The tokens a generation's constraint forces next, as a chain source for the default drafter
    (kind "forced", see `drafters.base.ChainSource`): a schema's keys and punctuation drafted for
    free. Its chain is a function of the committed text (the matcher follows it), so drafting it is
    lossless like any point mass."""

    kind = "forced"

    def __init__(self, matcher: Matcher):
        self.matcher = matcher

    def proposal(self, context: Sequence[int], max_tokens: int) -> list[int]:
        return self.matcher.forced()[:max_tokens]

    def end(self, context: Sequence[int]) -> None:
        pass
