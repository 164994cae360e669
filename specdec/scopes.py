"""Scopes: who may see what a generation leaves behind.

A generation leaves state that later ones use: its cache is kept for prefix reuse, its text joins
a history, its acceptance teaches the draft policy. Each changes what a later request is told
(`cached_tokens`) or how fast it runs, so each is kept per *scope*, and a request sees only its
own scope's. A server makes one scope per API key and `cache_salt` (a `KeyScope`); the library's
requests share the scope None unless they name one.

Bounded stores shed state fairly, by *owner* (a KeyScope's key: salts narrow what a request sees,
they do not earn a key more room): they evict from the owner that holds the most (its least
recently used entry first, `evictee`). An owner that adds state then evicts its own, or that of
owners holding more than it does, never that of one holding less; and an owner holding less than
1/n of a store is never evicted while n owners or fewer hold anything.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Generic, Hashable, Sequence, TypeVar

from specdec.errors import SpecDecError

Scope = Hashable  # any hashable value; None is the default scope
T = TypeVar("T")


@dataclass(frozen=True)
class KeyScope:
    """A server request's scope: its API key (an index; None: the server has no keys, or they share
    one scope) and its `cache_salt`."""

    key: int | None
    salt: str | None


def owner(scope: Scope) -> Hashable:
    """Whom a scope's state counts against in bounded stores: a KeyScope's key, any other scope itself."""
    return scope.key if isinstance(scope, KeyScope) else scope


def check_scope(value, what: str) -> None:
    """A scope or tenant must be hashable: it keys the stores."""
    try:
        hash(value)
    except TypeError:
        raise SpecDecError(f"{what} must be hashable (a string, a number, a tuple), "
                           f"got {type(value).__name__}") from None


def evictee(entries: Sequence[T], scope_of: Callable[[T], Scope], weight: Callable[[T], int] = lambda entry: 1) -> T:
    """The entry to evict: the least recently used one (entries come least recently used first)
    of the scope whose entries weigh the most in all. Ties go to the scope whose oldest entry is
    the oldest."""
    totals: dict[Scope, int] = {}
    for entry in entries:
        scope = scope_of(entry)
        totals[scope] = totals.get(scope, 0) + weight(entry)
    heaviest = max(totals.values())
    return next(entry for entry in entries if totals[scope_of(entry)] == heaviest)


class PerScope(Generic[T]):
    """One value per scope, made on first use by `make`; at most `limit` scopes are remembered (the
    least recently used forgotten)."""

    def __init__(self, make: Callable[[], T], limit: int = 256):
        self.make, self.limit = make, limit
        self._values: OrderedDict[Scope, T] = OrderedDict()
        self._lock = threading.Lock()

    def __getitem__(self, scope: Scope) -> T:
        with self._lock:
            value = self._values.get(scope)
            if value is None:
                value = self._values[scope] = self.make()
                while len(self._values) > self.limit:
                    self._values.popitem(last=False)
            self._values.move_to_end(scope)
            return value
