"""Generated text as it reads after its prompt, and text to continue a prompt with, as token ids.

Tokenizers do not split a continuation as they split the same text alone (SentencePiece-style ones
add or drop a leading space; a word may merge with the text before it), so both directions anchor
on the prompt's last tokens.
"""

from __future__ import annotations

import re

from specdec.errors import SpecDecError


def continuation_decoder(tokenizer, prompt_ids: list[int]):
    """Text of generated ids as it reads after the prompt.

    Decoding the new ids alone loses a leading space with SentencePiece-style tokenizers, so the
    prompt's last few ids are decoded with them and their own text is cut off again.
    """
    anchor = prompt_ids[-4:]
    anchor_text = tokenizer.decode(anchor, skip_special_tokens=True)

    def decode_text(tokens: list[int]) -> str:
        text = tokenizer.decode(anchor + tokens, skip_special_tokens=True)
        if text.startswith(anchor_text) and not anchor_text.endswith("\ufffd"):
            return text[len(anchor_text):]
        return tokenizer.decode(tokens, skip_special_tokens=True)

    return decode_text


_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece's byte fallback (Llama 2, Mistral, Gemma)


class GrowingText:
    """The text of a growing list of generated ids as it reads after the prompt (`continuation_decoder`'s),
    from a decode of its last ids only: once the unfixed ids reach 4 × WINDOW, the text of all but the last
    WINDOW is fixed, where decoding the two sides apart (the later ones behind the 4 ids before them) gives
    the text decoding across the split does; else the split waits for more ids. (A decode of the whole text
    every step grows with it: 0.13 ms a step after 1,000 tokens of the demo tokenizer; 10 us with this.)"""

    WINDOW = 16

    def __init__(self, tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self._whole = continuation_decoder(tokenizer, prompt_ids)
        self._prompt_tail = list(prompt_ids[-4:])
        # invariant: the text of ids[:n] (n >= _fixed) is _fixed_text + _tail(ids[_fixed:n])
        self._fixed, self._fixed_text, self._tail = 0, "", self._whole
        # a clean-up of spaces before punctuation reaches back across any split (" " then "." reads "."): whole
        never = getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._next_split = float("inf") if never else 4 * self.WINDOW
        self._bytes: dict[int, bool] = {}  # id -> whether it is a byte-fallback piece

    def text(self, tokens: list[int]) -> str:
        """The text of `tokens`: the generated ids, or a prefix of them (one shorter than the fixed ones is
        decoded whole)."""
        if len(tokens) < self._fixed:
            return self._whole(tokens)
        text = self._fixed_text + self._tail(tokens[self._fixed:])
        if len(tokens) >= self._next_split:
            self._split(tokens, len(tokens) - self.WINDOW, text)
        return text

    def _split(self, tokens: list[int], at: int, text: str) -> None:
        if self._byte(tokens[at - 1]) and self._byte(tokens[at]):
            # a byte-fallback decoder reads a run of byte tokens whole: a later invalid byte turns the run's
            # earlier characters into U+FFFD too, so a run may not straddle the split
            self._next_split = len(tokens) + 1
            return
        head = self._tail(tokens[self._fixed : at])
        after = continuation_decoder(self.tokenizer, (self._prompt_tail + tokens[:at])[-4:])
        # a character, or a merge of the decoder's, spans the split: wait for more ids
        if head.endswith("\ufffd") or self._fixed_text + head + after(tokens[at:]) != text:
            self._next_split = len(tokens) + self.WINDOW
            return
        self._fixed, self._fixed_text, self._tail = at, self._fixed_text + head, after
        self._next_split = at + 4 * self.WINDOW

    def _byte(self, token: int) -> bool:
        """Whether the id is a byte-fallback piece ("<0xE2>"), asked of the tokenizer once per id."""
        if token not in self._bytes:
            pieces = getattr(self.tokenizer, "convert_ids_to_tokens", None)  # a tokenizer without pieces has none
            self._bytes[token] = bool(pieces) and bool(_BYTE_PIECE.fullmatch(str(pieces(token))))
        return self._bytes[token]


def continuation_ids(tokenizer, anchor: list[int], text: str) -> list[int]:
    """Token ids that spell `text` after the ids `anchor` (the last few committed tokens): `text`
    encoded behind the anchor's own text, the anchor's ids cut off again; when the two do not split
    at the same place, `text` encoded alone."""
    anchor_text = tokenizer.decode(anchor, skip_special_tokens=True)
    ids = tokenizer.encode(anchor_text + text, add_special_tokens=False)
    for start in range(min(len(ids), len(anchor) + 2), -1, -1):  # the anchor may encode to a token more or fewer
        if tokenizer.decode(ids[:start], skip_special_tokens=True) == anchor_text:
            return ids[start:]
    return tokenizer.encode(text, add_special_tokens=False)


def check_text(text: str, what: str, param: str | None = None) -> None:
    """Refuse text no tokenizer can take: a lone UTF-16 surrogate (JSON's "\\ud800", or a byte that
    was not UTF-8, which Python keeps in a command line's text as one of U+DC80..U+DCFF). param:
    the request field the error names."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        bad = ord(text[error.start])
        if 0xDC80 <= bad <= 0xDCFF:
            raise SpecDecError(f"the {what} is not valid UTF-8: byte 0x{bad - 0xDC00:02x} "
                               f"at character {error.start}", param=param) from None
        raise SpecDecError(f"the {what} is not valid Unicode text: a lone surrogate U+{bad:04X} "
                           f"at character {error.start}", param=param) from None
