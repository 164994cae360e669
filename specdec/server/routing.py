"""Which Ray Serve replica a request goes to: the one whose caches hold its conversation.

The ingress names a request's conversation (`affinity`: a session header, else the start of its
prompt, both tagged with its tenant) and `ConversationRouter` sends it to the replica that served
that conversation while it accepts work; new conversations go by power of two choices.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from specdec.server.openai import text_of

AFFINITY_CHARS = 4096  # the start of a prompt a conversation is recognised by
TENANT_CHARS = 17  # the tenant tag that starts every session and prompt text the router remembers
# a new prompt goes to the replica of an earlier one that starts with its tag and 128 more characters
MIN_SHARED_CHARS = TENANT_CHARS + 128
REMEMBERED = 4096  # conversations the router remembers (least recently used forgotten)
SESSION_HEADER = b"x-session-id"


# ---------------------------------------------------------------------------- what crosses Ray
@dataclass(frozen=True)
class Forwarded:
    """An HTTP request as the ingress received it, for a replica's routes."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None
    http_version: str = "1.1"


class Affinity(NamedTuple):
    """What names a request's conversation: a session id (the X-Session-Id header, else the body's
    `user`), and the start of its prompt text, each after its tenant's tag (see `affinity`)."""

    session: str | None
    text: str


def affinity(headers: list[tuple[bytes, bytes]], body: bytes) -> Affinity:
    """A request's Affinity; a body that is not a JSON object gives an empty one (the replica's
    routes answer it with their 400). Both start with a tag of the request's tenant (a hash of its
    Authorization header and `cache_salt`): requests of another key or salt never follow this one's
    conversations, so the replica that answers (`X-Specdec-Replica`) tells nothing of other tenants'."""
    header = lambda wanted: next((value for name, value in headers if name.lower() == wanted), None)
    session = header(SESSION_HEADER)
    try:
        fields = json.loads(body) if body else {}
    except (ValueError, RecursionError):  # not JSON, or nested too deep to parse
        fields = {}
    fields = fields if isinstance(fields, dict) else {}
    salt = fields.get("cache_salt") if isinstance(fields.get("cache_salt"), str) else ""
    tag = hashlib.sha256((header(b"authorization") or b"") + b"\0"
                         + salt.encode("utf-8", "replace")).hexdigest()[: TENANT_CHARS - 1] + ":"
    user = fields.get("user") if isinstance(fields.get("user"), str) else None
    session = session.decode("latin-1") if session is not None else f"user:{user}" if user else None
    return Affinity(tag + session if session else None, tag + prompt_text(fields)[:AFFINITY_CHARS] if fields else "")


def prompt_text(fields: dict) -> str:
    """The text a request's prompt starts with: a completion's prompt, or a chat's message contents."""
    prompt, messages = fields.get("prompt"), fields.get("messages")
    if isinstance(messages, list):
        return "".join(text_of(m.get("content")) for m in messages if isinstance(m, dict))
    if isinstance(prompt, list):
        return " ".join(str(p) for p in prompt)  # token ids or texts: only equality matters
    return prompt if isinstance(prompt, str) else ""


# ---------------------------------------------------------------------------- routing
class ConversationRouter(RequestRouter):
    """Requests of one conversation go to the replica that served it (its prefix cache and history
    are warm there): the same session, else the longest remembered prompt (of at least
    MIN_SHARED_CHARS characters) this one starts with: a conversation's earlier turn, not merely a
    shared system prompt. That replica is tried first while it is alive and accepts
    work (fewer than its `max_ongoing_requests`); otherwise, and for new conversations, power of
    two choices, Ray's default.

    Ray's own prefix router (`ray.serve.llm`'s PrefixCacheAffinityRouter) needs ray.serve.llm's
    dependencies and request types, knows no sessions, and blocks its event loop on a tree actor;
    this one keeps its memory in the ingress's router (one per ingress replica) and finds a
    prompt's earlier turns by their first MIN_SHARED_CHARS characters, then `startswith`. Not
    FIFOMixin: it hands a replica chosen for one request to whichever request waits longest."""

    def initialize_state(self, **kwargs):
        self.sessions: OrderedDict[str, ReplicaID] = OrderedDict()
        self.texts: OrderedDict[str, ReplicaID] = OrderedDict()  # prompt starts, at least MIN_SHARED_CHARS long
        self.by_start: dict[str, set[str]] = {}  # their first MIN_SHARED_CHARS characters -> them

    def home(self, request: PendingRequest | None) -> ReplicaID | None:
        """The replica that served this request's conversation, if one did: its session's, else the
        one of the longest remembered prompt this one starts with."""
        wanted = _affinity(request)
        if wanted is None:
            return None
        if wanted.session is not None and wanted.session in self.sessions:
            return self.sessions[wanted.session]
        earlier = [text for text in self.by_start.get(wanted.text[:MIN_SHARED_CHARS], ())
                   if wanted.text.startswith(text)]
        return self.texts[max(earlier, key=len)] if earlier else None

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        pair = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        home = self.home(pending_request)
        warm = [replica for replica in candidate_replicas if replica.replica_id == home]
        return [warm, [r for r in pair if r.replica_id != home]] if warm else [pair]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult):
        wanted = _affinity(pending_request)
        if wanted is None:
            return
        if wanted.session is not None:
            self._remember(self.sessions, wanted.session, replica_id)
        if len(wanted.text) >= MIN_SHARED_CHARS:
            self._remember(self.texts, wanted.text, replica_id)
            self.by_start.setdefault(wanted.text[:MIN_SHARED_CHARS], set()).add(wanted.text)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        for memory in (self.sessions, self.texts):
            for key in [key for key, replica in memory.items() if replica == replica_id]:
                self._forget(memory, key)

    def _remember(self, memory: OrderedDict, key: str, replica_id: ReplicaID) -> None:
        memory[key] = replica_id
        memory.move_to_end(key)
        while len(memory) > REMEMBERED:
            self._forget(memory, next(iter(memory)))

    def _forget(self, memory: OrderedDict, key: str) -> None:
        del memory[key]
        if memory is self.texts:
            starts = self.by_start[key[:MIN_SHARED_CHARS]]
            starts.discard(key)
            if not starts:
                del self.by_start[key[:MIN_SHARED_CHARS]]


def _affinity(request: PendingRequest | None) -> Affinity | None:
    """The Affinity the ingress gave the call (a tuple: the class the router sees may be another
    copy of Affinity, unpickled by value)."""
    wanted = request.kwargs.get("affinity") if request is not None else None
    return Affinity(*wanted) if isinstance(wanted, tuple) else None
