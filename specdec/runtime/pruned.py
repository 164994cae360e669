"""A draft that predicts only part of the target's vocabulary (a distilled draft, `specdec.distill`).

The draft model has its own small vocabulary: draft id i stands for target id `target_ids[i]`, and
one more id, `unknown`, stands for every other target token in its input. `PrunedVocab` wraps the
loaded draft so that it takes target ids and gives logits over its own predicted tokens only:
column c is target id `columns[c]`, and every other target token has q = 0. Drafters choose in
that space and map only the chosen tokens to target ids, and the verifier reads q there
(`Draft.columns`): nothing is widened to the target's vocabulary. Speculative sampling stays
exact: the draft never proposes a token outside its columns, and the residual max(0, p - q) = p
there gives the target its full mass back after a rejection. The unknown id is an input only; it
is never proposed either.

The map travels with the draft: `vocab_map.json` in a checkpoint directory, the metadata keys
`specdec.vocab_map.*` in a GGUF file. It records the target tokenizer's fingerprint, so a draft is
refused beside a target whose string -> id map differs from the one it was distilled from.
"""

from __future__ import annotations

import ctypes
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specdec.errors import SpecDecError
from specdec.runtime import base
from specdec.runtime.vocab import tokenizer_fingerprint

MAP_FILE = "vocab_map.json"
GGUF_KEYS = ("specdec.vocab_map.target_ids", "specdec.vocab_map.target_fingerprint",
             "specdec.vocab_map.target_vocab_size")


@dataclass(frozen=True)
class VocabMap:
    target_ids: tuple[int, ...]  # draft id i predicts target id target_ids[i]; draft id len(target_ids) = unknown
    target_vocab_size: int
    target_fingerprint: str

    @property
    def unknown(self) -> int:
        return len(self.target_ids)

    @property
    def draft_vocab_size(self) -> int:
        return len(self.target_ids) + 1

    def check(self) -> None:
        ids = np.asarray(self.target_ids)
        if (len(ids) == 0 or len(set(self.target_ids)) != len(ids) or ids.min() < 0
                or ids.max() >= self.target_vocab_size):
            raise SpecDecError("a vocabulary map must list distinct target ids within the target's vocabulary")

    def to_draft(self) -> np.ndarray:
        """[target vocab] -> draft id (unknown for tokens the draft does not predict)."""
        table = np.full(self.target_vocab_size, self.unknown, dtype=np.int64)
        table[list(self.target_ids)] = np.arange(len(self.target_ids))
        return table

    def save(self, directory: str | Path) -> None:
        (Path(directory) / MAP_FILE).write_text(json.dumps({
            "target_ids": list(self.target_ids), "target_vocab_size": self.target_vocab_size,
            "target_fingerprint": self.target_fingerprint}))

    @staticmethod
    def of(path: str | Path) -> VocabMap | None:
        """The map stored with a draft (a checkpoint directory or a GGUF file), or None for a draft
        with the target's own vocabulary."""
        path = Path(path)
        if path.is_dir():
            file = path / MAP_FILE
            if not file.is_file():
                return None
            saved = json.loads(file.read_text())
            return VocabMap(tuple(saved["target_ids"]), saved["target_vocab_size"], saved["target_fingerprint"])
        if path.suffix.lower() == ".gguf" and path.is_file():
            return _gguf_map(path)
        return None


def _gguf_map(path: Path) -> VocabMap | None:
    """The map in a GGUF file's metadata, read by llama.cpp's own GGUF reader (metadata only: a
    multi-GB draft without a map costs milliseconds here)."""
    import llama_cpp

    from specdec.runtime.cpu_head import GGUF_INT32, GGUF_UINT32, _ggml_base, open_gguf

    library = _ggml_base(llama_cpp)
    try:
        with open_gguf(library, path) as gguf:
            ids_key, fingerprint_key, size_key = (library.gguf_find_key(gguf, key.encode()) for key in GGUF_KEYS)
            if ids_key < 0:
                return None
            if (min(fingerprint_key, size_key) < 0
                    or library.gguf_get_arr_type(gguf, ids_key) not in (GGUF_INT32, GGUF_UINT32)):
                raise SpecDecError(f"{path}: its specdec.vocab_map metadata is incomplete")
            count = library.gguf_get_arr_n(gguf, ids_key)
            ids = np.ctypeslib.as_array((ctypes.c_int32 * count).from_address(library.gguf_get_arr_data(gguf, ids_key)))
            return VocabMap(tuple(int(i) for i in ids), int(library.gguf_get_val_u32(gguf, size_key)),
                            library.gguf_get_val_str(gguf, fingerprint_key).decode())
    except ValueError as error:
        raise SpecDecError(f"{path}: {error}") from error


class PrunedVocab:
    """A draft model with a `VocabMap`: target ids in (`vocab_size` is the target's), logits over its
    own predicted tokens out, whose target ids are `columns` (see the module docstring)."""

    def __init__(self, draft: base.CausalLM, vocab_map: VocabMap, target_tokenizer):
        vocab_map.check()
        if vocab_map.draft_vocab_size != draft.vocab_size:
            raise SpecDecError(f"{draft.path}: its vocabulary map covers {vocab_map.draft_vocab_size} draft tokens, "
                               f"the model has {draft.vocab_size}")
        fingerprint = tokenizer_fingerprint(target_tokenizer, spaces_as_written=True)
        if vocab_map.target_fingerprint != fingerprint or vocab_map.target_vocab_size != len(target_tokenizer):
            raise SpecDecError(f"the draft {draft.path} was distilled for another tokenizer than the target's "
                               f"(fingerprint {vocab_map.target_fingerprint} vs {fingerprint})")
        self.inner, self.vocab_map = draft, vocab_map
        self.tokenizer, self.vocab_size = target_tokenizer, vocab_map.target_vocab_size
        self.stop_token_ids = frozenset(int(vocab_map.target_ids[i]) for i in draft.stop_token_ids
                                        if i < vocab_map.unknown)
        self._to_draft = torch.from_numpy(vocab_map.to_draft())
        # [columns]: the target id of each logit's column
        self.columns = torch.tensor(vocab_map.target_ids, dtype=torch.long)

    device_logits = False  # logits come back on the CPU, one column per predicted token (`columns`)
    peer_kind = None  # specdec's own vocabulary map: no other library's loop takes it
    times_ops = False

    # the rest is the draft model's own: its file, how it runs, what its cache holds
    path = property(lambda self: self.inner.path)
    backend = property(lambda self: self.inner.backend)
    device = property(lambda self: self.inner.device)
    on_gpu = property(lambda self: self.inner.on_gpu)
    max_length = property(lambda self: self.inner.max_length)
    weight_bytes = property(lambda self: self.inner.weight_bytes)
    parameters = property(lambda self: self.inner.parameters)
    dtype = property(lambda self: self.inner.dtype)
    tree_tolerance = property(lambda self: self.inner.tree_tolerance)
    spare_cells = property(lambda self: self.inner.spare_cells)
    spare_sequences = property(lambda self: self.inner.spare_sequences)
    hidden_size = property(lambda self: self.inner.hidden_size)
    max_sequence_ids = property(lambda self: self.inner.max_sequence_ids)
    batch_invariant = property(lambda self: self.inner.batch_invariant)
    threads = property(lambda self: self.inner.threads)
    output_layer = property(lambda self: self.inner.output_layer)
    compile_backend = property(lambda self: self.inner.compile_backend)
    compile_seconds = property(lambda self: self.inner.compile_seconds)
    reads_target_states = property(lambda self: self.inner.reads_target_states)
    state_layers = property(lambda self: self.inner.state_layers)
    layer_count = 0  # never a target

    def keep_states(self, on: bool = True) -> None:
        self.inner.keep_states(on)

    def verify_room(self, root_position: int) -> int:
        return self.inner.verify_room(root_position)

    def warm_up(self, rows: int = 1) -> float:
        return self.inner.warm_up(rows)

    def tree_refusal(self) -> str | None:
        return self.inner.tree_refusal()

    def input_embeddings(self, device="cpu", dtype=None) -> None:
        return None  # its rows are in draft ids; a pruned model is never a target

    def output_rows(self, embeddings: torch.Tensor | None = None) -> None:
        return None

    def describe(self) -> str:
        return f"{self.inner.describe()}, predicting {len(self.columns)} of the target's {self.vocab_size} tokens"

    def sequence(self) -> PrunedSequence:
        return PrunedSequence(self, self.inner.sequence())

    def draft_tokens(self, tokens) -> list[int]:
        return self._to_draft[torch.as_tensor(tokens, dtype=torch.long).reshape(-1)].tolist()

    def predicted(self, logits: torch.Tensor) -> torch.Tensor:
        """[n, draft vocab] -> [n, columns]: the unknown id's column dropped (an input only)."""
        return logits[:, : len(self.columns)]

    def forward_batch(self, feeds: list[base.Feed]) -> list[torch.Tensor]:
        inner = [base.Feed(f.sequence.inner, self.draft_tokens(f.tokens), f.parents, f.last) for f in feeds]
        return [self.predicted(logits) for logits in self.inner.forward_batch(inner)]


class PrunedSequence:
    """A draft sequence that takes target ids; everything but `forward` is the inner sequence's."""

    def __init__(self, owner: PrunedVocab, inner: base.CachedSequence):
        self.owner, self.inner = owner, inner

    @property
    def cache_len(self) -> int:
        return self.inner.cache_len

    def forward(self, tokens, parents=None, last: int | None = None) -> torch.Tensor:
        return self.owner.predicted(self.inner.forward(self.owner.draft_tokens(tokens), parents, last))

    def keep(self, start: int, indices) -> None:
        self.inner.keep(start, indices)

    def truncate(self, length: int) -> None:
        self.inner.truncate(length)

    def release(self) -> None:
        self.inner.release()

    def observe(self, first: int, states: torch.Tensor) -> None:  # a head's (`runtime.head`)
        self.inner.observe(first, states)

    def fork(self, length: int) -> PrunedSequence | None:
        forked = self.inner.fork(length)
        return None if forked is None else PrunedSequence(self.owner, forked)
