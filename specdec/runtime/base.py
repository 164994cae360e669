"""The runtime protocol: everything the engine, drafters, API, bench and server may use of a model.

A runtime (Hugging Face transformers, llama.cpp) holds one loaded model and hands out *sequences*:
slots with their own KV cache, several at once. A sequence's cache is a list of entries, one per
token fed. Every entry has a parent entry (the token before it on its path) and sits at position
parent's position + 1, attending to its ancestors and itself only: a chain of text is entries whose
parent is the entry before; a token tree is entries whose parents branch. Nothing above
`specdec.runtime` touches a backend's own objects.

`tree_check` is shared: on any runtime, a 2-node tree must give each node the logits of its own
path computed alone before trees are used there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence as Seq

import torch

from specdec.errors import SpecDecError


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer specdec uses; the GGUF tokenizer implements the same."""

    eos_token_id: int | None
    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Seq[int], skip_special_tokens: bool = True) -> str: ...

    def get_vocab(self) -> dict[str, int]: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool, tokenize: bool,
                            tools: list[dict] | None = None) -> list[int]: ...

    def __len__(self) -> int: ...


class CachedSequence(Protocol):
    """One sequence slot. Invariant: the cache holds exactly `cache_len` entries, in feeding order."""

    cache_len: int
    # While the model keeps states (`CausalLM.keep_states`): set by every forward that fed this
    # sequence (its own `forward` or the model's `forward_batch`) to the rows its output layer
    # multiplied, the final norm's output, for exactly the rows of logits returned (a tree's node:
    # its own path's), [rows returned, hidden_size], float32 (float64 kept), on the logits' device;
    # kept at `layers`: the inputs of those decoder layers side by side, for every token fed,
    # [tokens fed, len(layers) * hidden_size]. In both, the last rows are the last tokens fed.
    # None while states are off.
    states: torch.Tensor | None

    def forward(self, tokens: Seq[int] | torch.Tensor, parents: Seq[int] | None = None,
                last: int | None = None) -> torch.Tensor:
        """Append entries for `tokens` and return next-token logits, [n, vocab] float on the CPU
        (a model with `device_logits` also takes on_device=True: they stay on its device).

        parents[i]: the entry index token i follows (-1: none, position 0); every parent is an
        earlier entry, cached or new. Default: a chain after the last entry. `last`: return only
        the last `last` rows (a prefill needs none of the others)."""
        ...

    def keep(self, start: int, indices: Seq[int]) -> None:
        """Keep the first `start` entries, then the entries at `indices`, which must be a chain
        below entry start - 1, moved to slots start, start + 1, ... (a tree's accepted path stays)."""
        ...

    def truncate(self, length: int) -> None:
        """Keep the first `length` entries."""
        ...

    def release(self) -> None:
        """Free the slot; the sequence must not be used afterwards."""
        ...

    def fork(self, length: int) -> CachedSequence | None:
        """A new sequence holding this one's first `length` entries, which must be committed text
        (a chain from position 0); the two go on independently. None when the entries cannot be
        shared exactly (a fresh sequence would compute them differently)."""
        ...


class CausalLM(Protocol):
    """A loaded model: facts about it, and sequences to decode in."""

    path: str
    backend: str  # its runtime, for messages and reports: "transformers", "llamacpp" (a draft head: "head")
    device: str  # where its logits and states come out: "cpu", "cuda:0" (llama.cpp: "cpu", whatever it offloads)
    on_gpu: bool  # its forwards run on a GPU, in whole or in part (offloaded layers)
    tokenizer: Tokenizer
    vocab_size: int  # rows of logits: the tokenizer's real vocabulary
    max_length: int  # positions a sequence may fill (prompt, generated tokens and draft nodes)
    weight_bytes: int  # bytes of weights one forward reads
    parameters: int
    dtype: str  # "float32", "float16", "q4_k" ...
    stop_token_ids: frozenset[int]  # end-of-generation tokens (EOS, EOT ...)
    tree_tolerance: float  # how far a tree node's logits may be from its path's alone, relative to their scale
    spare_cells: int | None  # cache entries that finished sequences may keep (`PrefixCache`); None: no fixed limit
    spare_sequences: int | None  # sequences that finished sequences may keep (`PrefixCache`); None: no limit of its own
    device_logits: bool  # its sequences can leave logits on the model's device (`Feed.on_device`)
    hidden_size: int  # the width of `CachedSequence.states`: what the output layer multiplies
    layer_count: int  # decoder layers whose inputs `keep_states` can give (0: none, a draft head)
    max_sequence_ids: int | None  # ids its sequences and their tree branches share (llama.cpp); None: no limit
    batch_invariant: bool  # a row's logits are bitwise the same in a batch of any size (checked at load)
    threads: int | None  # CPU threads its forwards use; None: torch's, process-wide
    output_layer: str | None  # who computes a GGUF model's logits: "specdec" (`cpu_head`), "llama.cpp" or "split"
    # (llama.cpp's for a one-row forward, specdec's for more); None: its own
    compile_backend: str | None  # how a static pool's forwards run (`static.COMPILE_BACKENDS`); None: eagerly
    compile_seconds: dict[tuple[int, ...], float]  # a compiled shape (rows, tokens, ...) -> its first forward's seconds
    columns: torch.Tensor | None  # [columns]: each logit column's target id (`PrunedVocab`); None: every id in order
    reads_target_states: bool  # its sequences take the target's verified states (`observe`: a draft head)
    peer_kind: str | None  # whose generation loops the bench runs on it beside specdec's (`bench.peers`); None: none
    times_ops: bool  # its forward's time can be split by kind of op (`runtime.op_times`, `specdec profile --breakdown`)

    def keep_states(self, on: bool = True, layers: tuple[int, ...] | None = None) -> None:
        """From now on every forward leaves `states` on each sequence it fed (see `CachedSequence`):
        the final norm's output, or with `layers` the inputs of those decoder layers (a model with
        `layer_count` layers); off (the default) it leaves None and nothing extra is computed or
        kept. Raises SpecDecError where the states cannot be had exactly."""
        ...

    def sequence(self) -> CachedSequence:
        """A new empty sequence slot."""
        ...

    def narrow_output(self, ids=None) -> bool:
        """A target's (`CheckedTrees`): from now on logits over only these target ids, in this order, where
        the backend computes just their rows; None: the whole vocabulary. Returns whether it narrowed."""
        ...

    def input_embeddings(self, device: torch.device | str = "cpu",
                         dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """Its input embedding matrix, [vocab, hidden_size] on `device` in `dtype`; None where its weights are not read.
        Where the model holds it there already, its own tensor (read-only), not a copy: an 8B target's is 1 GB."""
        ...

    def output_rows(self, embeddings: torch.Tensor | None = None) -> torch.Tensor | None:
        """Its output matrix, [vocab_size, hidden_size] float32 on the CPU; None where its weights cannot be read.
        `embeddings`: its `input_embeddings()`, already read, which a model whose output layer ties them returns."""
        ...

    def warm_up(self, rows: int = 1) -> float:
        """Compile now (on a GPU: capture) the forwards that decoding batches of up to `rows` sequences runs,
        not inside the first requests; the seconds it took, 0.0 where nothing is compiled."""
        ...

    def describe(self) -> str:
        """The path and how the model runs, for messages."""
        ...

    def verify_room(self, root_position: int) -> int:
        """How many positions after `root_position` may be fed in one forward with it."""
        ...

    def tree_refusal(self) -> str | None:
        """Why token trees cannot be scored exactly on this model, or None when they can."""
        ...

    def forward_batch(self, feeds: list[Feed]) -> list[torch.Tensor]:
        """What `forward` returns for each feed, computed together: one model forward over every
        sequence's new entries where the backend can (rows of any lengths, chains and trees mixed).
        Each sequence appears at most once."""
        ...


@dataclass
class Feed:
    """One sequence's share of a batched forward: the arguments of `CachedSequence.forward`."""

    sequence: CachedSequence
    tokens: Seq[int]
    parents: Seq[int] | None = None
    last: int | None = None
    on_device: bool = False  # the logits may stay on the model's device; only for a model with `device_logits`


def wanted_count(last: int | None, n: int) -> int:
    """How many of n new tokens' logits a forward asked for `last` of them gives: its last ones (None: all)."""
    return n if last is None else min(last, n)


def forward_each(feeds: Seq[Feed]) -> list[torch.Tensor]:
    """`forward_batch` one sequence at a time: the reference, and what a model without batching does."""
    check_distinct(feeds)
    return [feed.sequence.forward(feed.tokens, feed.parents, feed.last,
                                  **({"on_device": True} if feed.on_device else {}))
            for feed in feeds]


def forward_together(model: CausalLM, growers: list, timed: Callable[[list[tuple[int, int]], float], None] | None = None
                     ) -> list:
    """Run generators side by side, batching their forwards: each yields Feeds of `model` (one at a
    time) and is sent back the logits; whatever is waiting goes into one `forward_batch`. Returns
    what each generator returns, or the exception it raised (its row ends there, the others go on);
    a failed forward raises. `timed`, where given, is told each forward's (tokens, rows) and the
    seconds from the first forward to the generators' end (their work between forwards included)."""
    results, waiting, forwards = [None] * len(growers), {}, []

    def advance(i: int, logits) -> None:
        try:
            waiting[i] = growers[i].send(logits)
        except StopIteration as done:
            results[i] = done.value
            waiting.pop(i, None)
        except Exception as error:
            results[i] = error
            waiting.pop(i, None)

    for i in range(len(growers)):
        advance(i, None)
    started = time.perf_counter()
    while waiting:
        order = list(waiting)
        feeds = [waiting[i] for i in order]
        if timed is not None:
            forwards.append((sum(len(feed.tokens) for feed in feeds), len(feeds)))
        for i, logits in zip(order, model.forward_batch(feeds)):
            advance(i, logits)
    if timed is not None and forwards:
        timed(forwards, time.perf_counter() - started)
    return results


def check_state_layers(model: CausalLM, layers: Seq[int]) -> None:
    """Layers whose inputs a model can give: distinct, from 1 (the first layer's input is the
    token embeddings, which a head takes itself) to its last."""
    count = getattr(model, "layer_count", 0)
    if not layers or len(set(layers)) != len(layers) or not all(1 <= i < count for i in layers):
        raise SpecDecError(f"{model.describe()} gives the inputs of its decoder layers 1 to {count - 1}, "
                           f"not {list(layers)}")


def check_distinct(feeds: Seq[Feed]) -> None:
    if len({id(feed.sequence) for feed in feeds}) != len(feeds):
        raise ValueError("a batched forward takes each sequence at most once")


def to_host(rows: torch.Tensor) -> torch.Tensor:
    """A draft head's rows of logits on the host, in float32, where its drafter reads them (one copy a level
    on a GPU)."""
    return rows.float().cpu()


def synchronize(device) -> None:
    """Wait for the device (a no-op on the CPU): timings of forwards that return before it is done need it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def require_trees(model: CausalLM) -> None:
    reason = model.tree_refusal()
    if reason is not None:
        raise SpecDecError(f"{model.describe()} does not support token trees ({reason}); use a chain")


_UNCHECKED: object = object()  # CheckedTrees._tree_refusal not computed yet (None means: trees are fine)


class CheckedTrees:
    """A target runtime's shared parts: `tree_refusal` computed once (on first use: the check costs
    forwards): the reason the backend knows by name (`known_tree_refusal`), else what `tree_check`
    finds; `narrow_output` where the backend cannot narrow."""

    _tree_refusal: str | None | object = _UNCHECKED

    def narrow_output(self, ids=None) -> bool:
        """Logits over only these target ids, where the backend computes just their rows (a training
        prefill's: most of a small model's forward can be its output layer); None: the whole vocabulary.
        Returns whether forwards now give the narrowed logits: here never."""
        return False

    def known_tree_refusal(self) -> str | None:
        """Why trees cannot be exact here, known without running the model (None: not known)."""
        return None

    def tree_refusal(self) -> str | None:
        """Why token trees cannot be scored exactly on this model, or None when they can."""
        if self._tree_refusal is _UNCHECKED:
            self._tree_refusal = self.known_tree_refusal() or tree_check(self)
        return self._tree_refusal


def tree_check(model: CausalLM) -> str | None:
    """A 2-node tree (two siblings below a prefix) must give each node the logits of its own path
    computed alone, within the model's rounding and far closer than a leaked mask would be (16-bit
    rounding is coarse). Returns why not, or None. Costs four tiny forwards."""
    prefix = [i % model.vocab_size for i in (1, 2, 3)]
    siblings = [4 % model.vocab_size, 5 % model.vocab_size]
    try:
        tree = model.sequence()
        tree.forward(prefix)
        # two children of the last prefix entry, in one forward: the engine's layout
        tree_logits = tree.forward(siblings, parents=[len(prefix) - 1] * 2)
        tree.release()
        alone = torch.stack([_last_logits(model, prefix + [token]) for token in siblings])
        leaked = _last_logits(model, prefix + siblings)  # the second sibling seeing the first: what a broken mask gives
    except SpecDecError:
        raise
    except Exception as error:  # a model whose attention cannot take the tree at all
        return f"a 2-node tree failed: {type(error).__name__}: {' '.join(str(error).split())[:200]}"
    error = float((tree_logits - alone).abs().max())
    tolerance = min(model.tree_tolerance * max(1.0, float(alone.abs().max())),
                    0.25 * float((leaked - alone[1]).abs().max()))
    if not error <= tolerance:
        return f"a 2-node tree's logits differ from its paths computed alone by {error:.3g} (> {tolerance:.3g})"
    return None


def _last_logits(model: CausalLM, tokens: list[int]) -> torch.Tensor:
    sequence = model.sequence()
    try:
        return sequence.forward(tokens, last=1)[0]
    finally:
        sequence.release()
