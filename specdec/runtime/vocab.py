"""The draft must map every string to the same id as the target (docs/design.md, pitfall 9)."""

from __future__ import annotations

import hashlib
import json

from specdec.errors import SpecDecError


def check_same_vocabulary(target_tokenizer, draft_tokenizer, draft_name: str = "draft") -> None:
    """Refuse a drafter whose tokenizer disagrees with the target's, naming the first mismatch.

    Padding rows in the embeddings do not matter: both models are restricted to the tokenizer's
    real vocabulary (len(tokenizer)) before any probability is computed.
    """
    target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if target_vocab == draft_vocab:
        return
    for token, token_id in sorted(target_vocab.items(), key=lambda item: item[1]):
        other = draft_vocab.get(token)
        if other != token_id:
            found = "is missing" if other is None else f"has id {other}"
            raise SpecDecError(
                f"the {draft_name} tokenizer does not match the target's: token {token!r} has id {token_id} "
                f"in the target but {found} in the {draft_name} ({len(target_vocab)} vs {len(draft_vocab)} tokens)"
            )
    extra = min(set(draft_vocab) - set(target_vocab), key=lambda t: draft_vocab[t])
    raise SpecDecError(
        f"the {draft_name} tokenizer has tokens the target lacks, first {extra!r} (id {draft_vocab[extra]}) "
        f"({len(target_vocab)} vs {len(draft_vocab)} tokens)"
    )


def tokenizer_fingerprint(tokenizer, spaces_as_written: bool = False) -> str:
    """A short hash of the string -> id map, stored with n-gram models to catch a tokenizer swap.

    spaces_as_written: SentencePiece's space mark "▁" hashed as the space it stands for. The same
    GGUF tokenizer read by transformers and by llama.cpp differs only there (llama.cpp writes
    Gemma's pieces of bare spaces with spaces), so a fingerprint taken so matches on both backends."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    if spaces_as_written:
        items = [(piece.replace("\u2581", " "), token_id) for piece, token_id in items]
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()[:16]
