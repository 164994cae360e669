"""The bookkeeping every backend's sequence keeps of its cache entries (`SequenceEntries`).

The backends differ in where keys and values live: a DynamicCache (`hf`), a row of the static pool
(`static`), llama.cpp cells under sequence ids (`llamacpp`). What an entry is does not differ: its
token, its parent and its position, and the checks of `place`, `keep`, `truncate` and `fork` on
them. A backend's sequence subclasses `SequenceEntries`, moves its own keys and values, and lets
this class record what the cache then holds.
"""

from __future__ import annotations

from typing import Sequence as Seq

from specdec import tree
from specdec.errors import SpecDecError


class SequenceEntries:
    """Tokens, positions and parents of one sequence's cache entries, and its trunk.

    Invariants: the cache holds exactly `cache_len` entries, entry i for the i-th token fed; entry i's
    parent is -1 or an earlier entry, and its position is its parent's + 1 (0 without a parent); the
    first `_trunk` entries are a chain from position 0 (each one's parent is the entry before): plain
    text, which every later entry attends to in full and which `fork` may share. Only `commit`,
    `keep_entries` and `share_entries` change them; `owner.max_length` bounds the entries."""

    def __init__(self, owner):
        self.owner = owner
        self._tokens: list[int] = []
        self._positions: list[int] = []
        self._parents: list[int] = []
        self._trunk = 0

    @property
    def cache_len(self) -> int:
        return len(self._positions)

    def place(self, tokens, parents: Seq[int] | None) -> tuple[list[int], list[int], list[int]]:
        """New entries, checked, not yet recorded: their tokens, their positions, and the parents of
        every entry once they are added."""
        start = self.cache_len
        tokens, parents = tree.new_entries(tokens, parents, start)
        max_length = self.owner.max_length
        if start + len(tokens) > max_length:  # positions stay below it too: an entry's position is at most its index
            raise SpecDecError(f"{len(tokens)} new tokens after {start} cached ones overflow the model's context "
                               f"of {max_length}")
        positions: list[int] = []
        for parent in parents:
            positions.append(0 if parent < 0
                             else (self._positions[parent] if parent < start else positions[parent - start]) + 1)
        return tokens, positions, self._parents + parents

    def commit(self, tokens: list[int], positions: list[int], all_parents: list[int]) -> None:
        """Record the entries `place` gave, once the cache holds them."""
        self._tokens += tokens
        self._positions += positions
        self._parents = all_parents
        self._extend_trunk()

    def _extend_trunk(self) -> None:
        while self._trunk < len(self._parents) and self._parents[self._trunk] == self._trunk - 1:
            self._trunk += 1

    def truncate(self, length: int) -> None:
        """Keep the first `length` entries (the backend's `keep`, which moves its keys and values,
        then calls `keep_entries`)."""
        if not 0 <= length <= self.cache_len:
            raise ValueError(f"cannot truncate a cache of {self.cache_len} entries to {length}")
        self.keep(length, [])

    def kept_path(self, start: int, indices: Seq[int]) -> list[int]:
        """`indices` as ints, checked for `keep`: a chain below entry start - 1."""
        indices = [int(i) for i in indices]
        tree.check_kept_path(self._parents, start, indices, self.cache_len)
        return indices

    def keep_entries(self, start: int, indices: list[int]) -> None:
        """Record `keep`: the first `start` entries, then the entries at `indices` at slots start,
        start + 1, ... (they keep their tokens and positions; their parents become a chain)."""
        self._tokens = self._tokens[:start] + [self._tokens[i] for i in indices]
        self._positions = self._positions[:start] + [self._positions[i] for i in indices]
        self._parents = self._parents[:start] + tree.chain_parents(len(indices), start)
        self._trunk = min(self._trunk, start)
        self._extend_trunk()

    def check_fork(self, length: int) -> None:
        if not 0 <= length <= self._trunk:
            raise ValueError(f"cannot fork the first {length} of {self.cache_len} entries: they must be committed text")

    def share_entries(self, other: SequenceEntries, length: int) -> None:
        """Record in an empty `other` this sequence's first `length` entries (plain text: `check_fork`)."""
        other._tokens, other._positions = self._tokens[:length], self._positions[:length]
        other._parents, other._trunk = tree.chain_parents(length), length
