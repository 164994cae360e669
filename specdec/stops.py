"""Stop strings in a growing text, in time linear in the text, whatever the stop strings' lengths.

Each stop string gets a Knuth–Morris–Pratt automaton run over the text as it grows: its state after
a character is the length of the longest suffix of the text so far that is a prefix of the stop
string (the whole string: a match). One pass over the new characters tells where a stop string
first ends, and how many characters at the end could still begin one (they are held back from the
client). The automaton's failure table is built lazily, only as far as the states reached, so a
stop string of 200,000 characters costs no more than the text it is matched against.
"""

from __future__ import annotations

from typing import Sequence


class StopStrings:
    """Scans a text that grows between calls (its end may be rewritten: a tokenizer's decode can
    change the last characters once more tokens follow); work per call is proportional to the
    characters new since the last call, plus a C-speed comparison of the old text with the new.

    Which stop wins: the first to *end* in the text, and of those ending at the same character the
    longest. That depends only on the text, not on how it was split into steps, so speculative
    decoding (several tokens a step) cuts exactly where plain decoding (one token a step) does, as
    long as decoding more tokens only appends text. Where a tokenizer rewrites the end of the text
    once more tokens arrive (clean-up of spaces before punctuation: "a ." becomes "a."), a stop that
    only the short-lived text contained can be seen by one step grouping and not by another."""

    def __init__(self, stops: Sequence[str]):
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        self.stops = list(stops)
        self._failure = [[0] for _ in self.stops]  # KMP prefix function of each stop, built as far as needed
        self._text = ""  # what has been scanned
        self._checkpoints = [(0, (0,) * len(self.stops))]  # (characters scanned, each automaton's state), per call

    def scan(self, text: str) -> tuple[int | None, int]:
        """(where the winning stop string begins in `text`, or None; how many characters at the end
        of `text` are a proper prefix of some stop string)."""
        scanned = self._rewind(text)
        states = list(self._checkpoints[-1][1])
        for position in range(scanned, len(text)):
            char, ended = text[position], 0
            for i, stop in enumerate(self.stops):
                states[i] = state = self._advance(i, states[i], char)
                if state == len(stop):
                    ended = max(ended, state)
            if ended:
                return position + 1 - ended, 0
        self._text = text
        self._checkpoints.append((len(text), tuple(states)))
        return None, max(states, default=0)

    def _rewind(self, text: str) -> int:
        """Drop checkpoints past the first character where `text` differs from the scanned text;
        returns how many characters of `text` the last checkpoint has scanned."""
        if not text.startswith(self._text):
            same = common_prefix(self._text, text)
            while self._checkpoints[-1][0] > same:
                self._checkpoints.pop()
        return self._checkpoints[-1][0]

    def _advance(self, i: int, state: int, char: str) -> int:
        """Stop i's automaton after one more character, from a state below its length."""
        stop, failure = self.stops[i], self._failure[i]
        while state and stop[state] != char:
            state = failure[state - 1]
        if stop[state] == char:
            state += 1
            if state < len(stop):
                _extend(stop, failure, state)
        return state


def _extend(stop: str, failure: list[int], length: int) -> None:
    """Extend the prefix function (failure[j]: the longest proper border of stop[:j + 1]) to `length` entries."""
    border = failure[-1]
    for j in range(len(failure), length):
        while border and stop[j] != stop[border]:
            border = failure[border - 1]
        if stop[j] == stop[border]:
            border += 1
        failure.append(border)


def common_prefix(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix of two strings or lists (token ids, say), by bisection
    over C-speed slice comparisons."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low
