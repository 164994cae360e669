"""Prefix reuse: finished sequences are kept, and a new one starts from the longest prefix it
shares with one of them (a conversation's earlier turn, a shared system prompt), so its prompt's
cached part is not computed again.

Scoped (`specdec.scopes`): a sequence kept for one scope is reused only by requests of the same
scope, so what another scope sent shows neither in `cached_tokens` nor in the time to the first
token. The budget is shared, shed fairly (`scopes.evictee`): the owner (a server's API key)
keeping the most tokens (or, for sequence ids, the most sequences) loses its least recently used
sequence first, so an owner keeping less than half of either is never evicted for another's sake
while two owners share the cache.

Exact: a reused entry is the one this model computed for the same token at the same position
after the same tokens. Where a runtime's numerics move with the batch shape (llama.cpp), it may
differ in the last bits from what a fresh prefill would compute, as a verify's entries already do.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Sequence as Seq

from specdec.errors import SpecDecError, check_integer
from specdec.runtime.base import CachedSequence, CausalLM
from specdec.scopes import Scope, evictee, owner
from specdec.stops import common_prefix

MIN_SHARED = 16  # a shorter shared prefix costs about as much to copy as to compute
MAX_KEPT = 16  # sequences kept at most (on llama.cpp each holds a sequence id, which tree branches need too)
# each model's shared cache (`PrefixCache.of`), both held weakly: an entry lives while its model
# and some decoder's cache do (a kept sequence holds its model, so the model outlives its cache)
_SHARED: weakref.WeakKeyDictionary[CausalLM, weakref.ref[PrefixCache]] = weakref.WeakKeyDictionary()
# every cache of each model, held weakly: a runtime whose cells are full asks them for room (`make_room`)
_CACHES: weakref.WeakKeyDictionary[CausalLM, weakref.WeakSet[PrefixCache]] = weakref.WeakKeyDictionary()


def make_room(model: CausalLM) -> bool:
    """Shed one sequence kept by a cache of `model` (see `PrefixCache.shed`): a runtime whose fixed
    cells are full calls it before it fails a decode. False when none is kept."""
    return any(cache.shed() for cache in list(_CACHES.get(model, ())))


@dataclass
class _Kept:
    sequence: CachedSequence | None  # None: one about to be kept, while room is made for it
    tokens: Seq[int]  # what its cache holds, entry by entry
    scope: Scope = None  # the requests that may reuse it


class PrefixCache:
    """Finished sequences of one model, kept with the tokens their caches hold and the scope that
    may reuse them, up to `budget` entries in all (shed as the module docstring says). Its list is
    guarded by a lock (metrics read `tokens` from other threads); the model's own calls (fork,
    release) are the engine's, made on its thread like every other call into the model.

    Invariant: every kept sequence's cache holds exactly its `tokens`, as a chain (committed text),
    the kept tokens add up to at most `budget` and the kept sequences to at most MAX_KEPT (fewer on a
    model that says `spare_sequences`). On
    llama.cpp the budget is also capped by the model's KV cells (`spare_cells`): kept prefixes take
    cells no running generation holds, and one is shed (`shed`) whenever a decode finds the cells
    full, so they never crowd out a running generation."""

    def __init__(self, model: CausalLM, budget: int, min_shared: int = MIN_SHARED):
        check_integer(budget, "a prefix cache's budget (tokens)", minimum=0)
        spare = model.spare_cells
        self.model, self.budget, self.min_shared = (model, budget if spare is None else min(budget, spare),
                                                    max(1, min_shared))
        # a model whose kept sequences each hold a whole row of a static pool keeps fewer (`static.KEPT_ROWS`)
        self.max_kept = min(MAX_KEPT, model.spare_sequences or MAX_KEPT)
        self._kept: list[_Kept] = []  # least recently used first
        self._lock = threading.RLock()
        self.reused_tokens = 0  # prompt tokens served from kept sequences, since the start
        _CACHES.setdefault(model, weakref.WeakSet()).add(self)

    @classmethod
    def of(cls, model: CausalLM, budget: int) -> PrefixCache:
        """The model's own cache, shared by every decoder that asks for one by budget: on llama.cpp
        their kept prefixes all live in the model's cells, so they share one budget (the largest
        asked for) rather than each keeping its own up to the cells.
        It is held weakly (its kept sequences hold the model): it lives as long as a decoder does."""
        reference = _SHARED.get(model)
        cache = reference() if reference is not None else None
        if cache is None:
            cache = cls(model, budget)
            _SHARED[model] = weakref.ref(cache)
        elif budget > cache.budget:
            spare = model.spare_cells
            cache.budget = budget if spare is None else min(budget, spare)
        return cache

    @property
    def tokens(self) -> int:
        """Tokens kept now."""
        with self._lock:
            return sum(len(kept.tokens) for kept in self._kept)

    def take(self, prompt: Seq[int], scope: Scope = None) -> CachedSequence:
        """A new sequence of the model holding the longest prefix of prompt[:-1] a sequence kept for
        the same scope shares (the last prompt token is always left to feed), or an empty one."""
        head = list(prompt[:-1])
        with self._lock:
            best, length = None, 0
            for kept in self._kept:
                shared = common_prefix(kept.tokens, head) if kept.scope == scope else 0
                if shared > length:
                    best, length = kept, shared
            if best is not None and length >= self.min_shared:
                sequence = best.sequence.fork(length)
                if sequence is not None:
                    self._kept.remove(best)
                    self._kept.append(best)
                    self.reused_tokens += length
                    return sequence
        return self.model.sequence()

    def put(self, sequence: CachedSequence, tokens: Seq[int], scope: Scope = None) -> None:
        """Keep the first entries of a finished sequence, whose cache begins with `tokens` (up to
        the budget's worth of them), for requests of `scope`, and release the sequence. What is kept
        is a fork: on transformers rows of its own, not views of a batch's tensors; on llama.cpp the
        same cells. It replaces the scope's kept sequences that hold a prefix of it."""
        tokens = list(tokens)[: self.budget]
        kept = None
        try:
            if self.min_shared <= len(tokens) <= sequence.cache_len and self._admit(tokens, scope):
                sequence.truncate(len(tokens))
                kept = sequence.fork(len(tokens))
        except SpecDecError:  # no sequence id to spare: nothing is kept
            kept = None
        finally:
            sequence.release()
        if kept is not None:
            with self._lock:
                self._kept.append(_Kept(kept, tokens, scope))

    def _admit(self, tokens: list[int], scope: Scope) -> bool:
        """Whether to keep `tokens` for `scope`, and if so, room made for them: not when one of its
        kept sequences holds them all already, nor when making room would shed them first (fairly,
        `scopes.evictee`, counting the scope's sequences they extend as gone). Only when they are
        kept do those sequences and the evicted ones go."""
        with self._lock:
            mine = [kept for kept in self._kept if kept.scope == scope]
            if any(common_prefix(kept.tokens, tokens) == len(tokens) for kept in mine):
                return False
            newcomer = _Kept(None, tokens, scope)
            gone = [kept for kept in mine if common_prefix(kept.tokens, tokens) == len(kept.tokens)]
            staying = [kept for kept in self._kept if kept not in gone]
            while (len(staying) + 1 > self.max_kept
                   or sum(len(kept.tokens) for kept in staying) + len(tokens) > self.budget):
                weight = (lambda kept: 1) if len(staying) + 1 > self.max_kept else (lambda kept: len(kept.tokens))
                victim = evictee(staying + [newcomer], lambda kept: owner(kept.scope), weight)
                if victim is newcomer:
                    return False
                staying.remove(victim)
                gone.append(victim)
            for kept in gone:
                self._drop(kept)
            return True

    def shed(self) -> bool:
        """Drop one kept sequence, giving back the cells it holds alone (the owner keeping the most
        tokens loses its least recently used, as when the budget is full). False when none is kept."""
        with self._lock:
            if not self._kept:
                return False
            self._drop(evictee(self._kept, lambda kept: owner(kept.scope), lambda kept: len(kept.tokens)))
            return True

    def clear(self) -> None:
        with self._lock:
            while self._kept:
                self._drop(self._kept[0])

    def _drop(self, kept: _Kept) -> None:
        self._kept.remove(kept)
        kept.sequence.release()
