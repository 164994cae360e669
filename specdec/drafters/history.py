"""History across requests (suffix decoding): earlier requests' prompts and outputs, drafted from
like prompt lookup.

A `History` keeps, per tenant, the token ids of recent generations (prompt and output, one
document each) packed 4 bytes an id and separated by a SEPARATOR, bounded by a token budget:
the oldest documents go first. A generation drafts from a `HistoryView`: the longest suffix of
its context (HISTORY_NGRAMS tokens, longest first) found in its tenant's documents, and what
followed there, never across a document's end. Where the output goes on copying what it
followed, the view follows the same place (no search: a long copied passage costs nothing per
iteration); elsewhere it searches again, in C.

Proposals are point masses, verified like prompt lookup's: whatever the history holds, the output
is the target's. What it holds changes only the speed, and speed is a timing side channel, so a
generation drafts only from its own scope (`specdec.scopes`: a server's API key and `cache_salt`)
and, within it, its own tenant's requests (a `user`; `shared`: every tenant of the scope's). A
tenant narrows a scope, never widens one. When more than `tenants` are kept, the least recently
used tenant of the owner (`scopes.owner`: a server's API key) keeping the most tenants goes: an
owner cannot push out another's history while it keeps fewer tenants than that one. The store is
thread-safe: a view reads the immutable bytes it was given when its request was made (a server
makes requests on the event loop, drafts and records on the batch thread).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from typing import Hashable, Sequence

from specdec.config import HISTORY_TOKENS
from specdec.drafters.prompt_lookup import SEPARATOR, continuation_in, packed
from specdec.scopes import Scope, evictee, owner

# suffix lengths looked up in the history, longest first: short matches in a big corpus are noise
HISTORY_NGRAMS = (8, 5, 3)
DEFAULT_TENANTS = 64  # tenants kept in all (see the module docstring for which goes first)


class _Documents:
    """One tenant's documents, oldest first, each ending with a SEPARATOR."""

    def __init__(self):
        self.corpus = b""
        self.sizes: deque[int] = deque()  # bytes per document, separator included

    def add(self, ids: Sequence[int], budget: int) -> None:
        ids = list(ids[-budget:])  # a document longer than the budget keeps its end
        corpus = self.corpus + packed(ids + [SEPARATOR])
        self.sizes.append(4 * (len(ids) + 1))
        drop = 0
        while len(corpus) - drop > 4 * (budget + len(self.sizes)):  # the budget counts tokens, not separators
            drop += self.sizes.popleft()
        self.corpus = corpus[drop:]


class History:
    """Earlier generations' prompts and outputs, per scope and tenant (see the module docstring).
    tokens: ids kept per tenant; tenants: tenants kept in all; shared: every request of a scope
    drafts from every request of that scope (one tenant per scope)."""

    def __init__(self, tokens: int = HISTORY_TOKENS, tenants: int = DEFAULT_TENANTS, shared: bool = False):
        if tokens < 1 or tenants < 1:
            raise ValueError("a history keeps at least one token of one tenant")
        self.tokens, self.tenants, self.shared = tokens, tenants, shared
        self._documents: OrderedDict[Hashable, _Documents] = OrderedDict()
        self._lock = threading.Lock()

    def _key(self, tenant: Hashable, scope: Scope) -> tuple:
        return scope, None if self.shared else tenant

    def view(self, tenant: Hashable = None, scope: Scope = None) -> HistoryView:
        """A generation's source of drafts: its tenant's history, in its scope, as it is now."""
        key = self._key(tenant, scope)
        with self._lock:
            documents = self._documents.get(key)
            if documents is not None:
                self._documents.move_to_end(key)
            return HistoryView(self, key, documents.corpus if documents else b"")

    def record(self, tenant: Hashable, ids: Sequence[int], scope: Scope = None) -> None:
        """A finished generation's context (prompt and output) joins its tenant's history."""
        self._record(self._key(tenant, scope), ids)

    def _record(self, key: tuple, ids: Sequence[int]) -> None:
        if not ids:
            return
        with self._lock:
            documents = self._documents.setdefault(key, _Documents())
            self._documents.move_to_end(key)
            documents.add(ids, self.tokens)
            while len(self._documents) > self.tenants:
                del self._documents[evictee(list(self._documents), scope_of=lambda key: owner(key[0]))]

    def clear(self) -> None:
        with self._lock:
            self._documents.clear()

    def size(self, tenant: Hashable = None, scope: Scope = None) -> int:
        """Tokens held for a tenant of a scope."""
        with self._lock:
            documents = self._documents.get(self._key(tenant, scope))
            return 0 if documents is None else len(documents.corpus) // 4 - len(documents.sizes)


class HistoryView:
    """One generation's drafts from its tenant's history (a chain source of the default drafter).
    `end` records the generation once it has finished."""

    kind = "history"

    def __init__(self, history: History, key: tuple, corpus: bytes):
        self.history, self.key, self.corpus = history, key, corpus  # key: (scope, tenant)
        self._ids = memoryview(corpus).cast("I")
        self._follow: int | None = None  # where in the corpus the context's next token was proposed from
        self._followed = 0  # the context's length when it was

    def proposal(self, context: Sequence[int], max_tokens: int) -> list[int]:
        """Up to max_tokens ids that followed the context's end in the history ([] when none did)."""
        if not self.corpus or max_tokens <= 0:
            return []
        follow = self._followed_place(context)
        if follow is not None:
            chain = self._ids[follow : follow + max_tokens].tolist()
            chain = chain[: chain.index(SEPARATOR)] if SEPARATOR in chain else chain
            if chain:
                self._follow, self._followed = follow, len(context)
                return chain
        place, chain = continuation_in(self.corpus, context, max_tokens, HISTORY_NGRAMS)
        # where the next iteration looks first
        self._follow, self._followed = (place, len(context)) if chain else (None, 0)
        return chain

    def _followed_place(self, context: Sequence[int]) -> int | None:
        """The corpus place after the context's new tokens, if they copy what was followed."""
        if self._follow is None:
            return None
        new = list(context[self._followed :])
        start = self._follow
        if self._ids[start : start + len(new)].tolist() != new:
            return None
        return start + len(new)

    def end(self, context: Sequence[int]) -> None:
        """The generation has finished with this context: it joins the history."""
        self.history._record(self.key, context)
