"""Katz-backoff trigram language model over token ids: the cheap "draft²" of staged drafting.

Given the last two token ids of a context it returns a proper distribution over the whole
vocabulary (float32 [V], non-negative, sums to 1) and its top token. Everything a query needs is
precomputed at build time, so a query is one pass over V plus two binary searches.

Model (V = vocabulary size, c(·) = counts inside single sequences; n-grams never cross sequences)
------------------------------------------------------------------------------------------------
* Unigram, add-one over the vocabulary:  P1(w) = (c(w) + 1) / (N + V)  > 0 for every id.
* Bigram / trigram (order m, history h of m−1 ids, seen continuation w with count r = c(h w)):
      P_katz(w | h) = d_r · r / c(h),     c(h) = Σ_w c(h w)  (h followed by something),
  with d_r = 1 for r > k (k = 5) and, for 1 ≤ r ≤ k, Katz's Good–Turing discount computed from
  that order's count-of-counts n_r (number of distinct m-grams seen exactly r times):
      r* = (r + 1) n_{r+1} / n_r,   A = (k + 1) n_{k+1} / n_1,   d_r = (r*/r − A) / (1 − A).
  Fallback (tiny corpora): if n_1 = 0 or A ≥ 1, or a d_r falls outside (0, 1], that d_r becomes
  the absolute discount d_r = (r − D) / r with D = n_1 / (n_1 + 2 n_2) (Ney's estimate), or
  D = 1/2 when n_1 or n_2 is 0. Either way every used d_r lies in (0, 1].
* Unseen continuations get the left-over mass through the backoff weight
      α(h) = (1 − Σ_{w seen after h} P_katz(w|h)) / (1 − Σ_{w seen after h} P_lower(w|h')),
  where h' drops the oldest id of h and P_lower is the full backed-off lower-order model
  (P1 for bigram histories, the backed-off bigram for trigram histories). So
      P(w | h) = P_katz(w | h) if h w was seen, else α(h) · P_lower(w | h').
  Degenerate histories: when the numerator or the denominator is ≤ 1e-9 (no mass left over, or
  the lower order has no mass outside the seen set, e.g. all V ids seen after h), α(h) = 0 and the
  seen P_katz(·|h) are renormalised to sum to 1. Then unseen ids get probability 0 there.
* A history never seen (as the prefix of an m-gram) backs off entirely: α(h) = 1. Contexts of
  0 or 1 ids use the unigram or the backed-off bigram directly.

Storage: n-grams are sorted int64 keys, bigram key = a·V + b, trigram key = (a·V + b)·V + c
(requires V³ < 2⁶³, i.e. V ≤ 2,097,151). A history's continuations are the keys in
[h·V, (h+1)·V), found with np.searchsorted. Probabilities and weights are computed in float64 and
stored as float32. `top_token` breaks ties towards the smallest id.
"""

from __future__ import annotations

import operator
import os
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from specdec.errors import SpecDecError

DISCOUNT_K = 5  # counts r <= DISCOUNT_K are Good-Turing discounted
_EPS = 1e-9  # masses at or below this count as zero when forming backoff weights
_MAX_VOCAB = 2_097_151  # largest V with V**3 < 2**63 (trigram keys fit in int64)
_FORMAT = "specdec.katz_trigram"
_FORMAT_VERSION = "1"
_MERGE_EVERY = 1 << 22  # raw keys buffered before they are folded into the running counts

# name -> dtype of every array in a saved model
_ARRAYS = {
    "unigram_probs": np.float32,  # [V]   P1(w)
    "bigram_backoff": np.float32,  # [V]   alpha(a); 1 where a has no seen continuation
    "bigram_keys": np.int64,  # [B]   sorted a*V + b
    "bigram_probs": np.float32,  # [B]   P_katz(b | a)
    "trigram_context_keys": np.int64,  # [H]   sorted a*V + b of histories with seen continuations
    "trigram_backoff": np.float32,  # [H]   alpha(a, b)
    "trigram_keys": np.int64,  # [T]   sorted (a*V + b)*V + c
    "trigram_probs": np.float32,  # [T]   P_katz(c | a, b)
}


# ----------------------------------------------------------------------------- pure math


def katz_discounts(counts: np.ndarray, k: int = DISCOUNT_K) -> np.ndarray:
    """Discount factors d[r] for r = 0..k of one order, from its n-gram counts (d[0] unused).

    Katz's formula where it gives a value in (0, 1]; else the absolute discount (r - D)/r.
    """
    n = np.bincount(np.asarray(counts, dtype=np.int64), minlength=k + 2).astype(np.float64)
    n1, n2 = n[1], n[2]
    big_d = n1 / (n1 + 2 * n2) if n1 > 0 and n2 > 0 else 0.5  # absolute discount, in (0, 1)
    d = np.ones(k + 1)
    a = (k + 1) * n[k + 1] / n1 if n1 > 0 else np.inf
    for r in range(1, k + 1):
        katz = np.nan
        if a < 1 and n[r] > 0:
            r_star = (r + 1) * n[r + 1] / n[r]
            katz = (r_star / r - a) / (1 - a)
        d[r] = katz if 0 < katz <= 1 else (r - big_d) / r
    return d


def _discounted_probs(counts: np.ndarray, history_counts: np.ndarray, k: int) -> np.ndarray:
    """P_katz = d_r * r / c(h) for each seen n-gram (all arrays aligned, float64 out)."""
    d = katz_discounts(counts, k)
    factor = np.where(counts <= k, d[np.minimum(counts, k)], 1.0)
    return factor * counts / history_counts


def _backoff(
    seen_probs: np.ndarray, lower_probs: np.ndarray, group: np.ndarray, n_groups: int
) -> tuple[np.ndarray, np.ndarray]:
    """Backoff weights per history and the (possibly renormalised) seen probabilities.

    seen_probs[i] = P_katz(w_i | h_{group[i]}), lower_probs[i] = P_lower(w_i | h'); float64.
    Returns alpha [n_groups] and probs aligned with seen_probs. Invariant afterwards, per history:
    sum(probs of seen) + alpha * (1 - sum(lower of seen)) == 1.
    """
    seen_mass = np.bincount(group, weights=seen_probs, minlength=n_groups)
    lower_mass = np.bincount(group, weights=lower_probs, minlength=n_groups)
    num = 1.0 - seen_mass
    den = 1.0 - lower_mass
    degenerate = (num <= _EPS) | (den <= _EPS)
    alpha = np.where(degenerate, 0.0, num / np.where(degenerate, 1.0, den))
    alpha[seen_mass == 0] = 1.0  # history without seen continuations: back off entirely
    renorm = np.where(degenerate & (seen_mass > 0), 1.0 / np.maximum(seen_mass, 1e-300), 1.0)
    return alpha, seen_probs * renorm[group]


def _estimate(
    unigram_counts: np.ndarray,
    bigram_keys: np.ndarray,
    bigram_counts: np.ndarray,
    trigram_keys: np.ndarray,
    trigram_counts: np.ndarray,
    vocab_size: int,
    k: int = DISCOUNT_K,
) -> dict[str, np.ndarray]:
    """All query tables (see _ARRAYS) from sorted unique keys and their counts."""
    v = vocab_size
    p1 = (unigram_counts + 1.0) / (unigram_counts.sum() + v)  # [V] add-one, > 0

    # bigrams: history a = key // V, continuation b = key % V
    a2, b2 = bigram_keys // v, bigram_keys % v
    hist2 = np.bincount(a2, weights=bigram_counts, minlength=v)  # [V] c(a)
    p2 = _discounted_probs(bigram_counts, hist2[a2], k)
    alpha2, p2 = _backoff(p2, p1[b2], a2, v)

    # trigrams: history key a*V+b = key // V, continuation c = key % V
    ctx3, c3 = trigram_keys // v, trigram_keys % v
    ctx_keys, group = np.unique(ctx3, return_inverse=True)
    hist3 = np.bincount(group, weights=trigram_counts, minlength=len(ctx_keys))
    p3 = _discounted_probs(trigram_counts, hist3[group], k)
    lower3 = _bigram_backoff_probs(ctx3 % v, c3, bigram_keys, p2, alpha2, p1, v)
    alpha3, p3 = _backoff(p3, lower3, group, len(ctx_keys))

    return {
        "unigram_probs": p1.astype(np.float32),
        "bigram_backoff": alpha2.astype(np.float32),
        "bigram_keys": bigram_keys,
        "bigram_probs": p2.astype(np.float32),
        "trigram_context_keys": ctx_keys.astype(np.int64),
        "trigram_backoff": alpha3.astype(np.float32),
        "trigram_keys": trigram_keys,
        "trigram_probs": p3.astype(np.float32),
    }


def _bigram_backoff_probs(b, c, bigram_keys, p2, alpha2, p1, v) -> np.ndarray:
    """Backed-off bigram P(c | b) for aligned id arrays b, c (float64)."""
    if len(bigram_keys) == 0:  # then there are no trigrams either
        return np.zeros(len(c))
    keys = b * v + c
    idx = np.minimum(np.searchsorted(bigram_keys, keys), len(bigram_keys) - 1)
    found = bigram_keys[idx] == keys
    # a within-sequence trigram (a, b, c) implies the bigram (b, c) was seen: `found` is all true
    return np.where(found, p2[idx], alpha2[b] * p1[c])


# ----------------------------------------------------------------------------- counting


def _as_ids(seq: Sequence[int], vocab_size: int) -> np.ndarray:
    """One sequence as int64 [n], checked to lie in [0, V)."""
    arr = np.asarray(seq)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise SpecDecError(f"a sequence must be 1-D integer token ids, got {arr.dtype}{list(arr.shape)}")
    arr = arr.astype(np.int64, copy=False)
    bad = arr[(arr < 0) | (arr >= vocab_size)]
    if len(bad):
        raise SpecDecError(f"token id {int(bad[0])} is outside the vocabulary [0, {vocab_size})")
    return arr


def _fold(keys: np.ndarray, counts: np.ndarray, pending: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Merge raw keys (count 1 each) into sorted unique keys with counts."""
    all_keys = np.concatenate([keys, *pending])
    all_counts = np.concatenate([counts, *(np.ones(len(p), np.int64) for p in pending)])
    uniq, inv = np.unique(all_keys, return_inverse=True)
    return uniq, np.bincount(inv, weights=all_counts, minlength=len(uniq)).astype(np.int64)


def _count(sequences: Iterable[Sequence[int]], vocab_size: int):
    """Unigram counts [V] and sorted unique bi/trigram keys with int64 counts."""
    v = vocab_size
    uni = np.zeros(v, dtype=np.int64)
    empty = (np.zeros(0, np.int64), np.zeros(0, np.int64))
    (bk, bc), (tk, tc) = empty, empty
    pend2: list[np.ndarray] = []
    pend3: list[np.ndarray] = []
    n_pending = 0
    for seq in sequences:
        ids = _as_ids(seq, v)
        uni += np.bincount(ids, minlength=v)
        pend2.append(ids[:-1] * v + ids[1:])
        pend3.append((ids[:-2] * v + ids[1:-1]) * v + ids[2:])
        n_pending += len(ids)
        if n_pending >= _MERGE_EVERY:
            (bk, bc), (tk, tc) = _fold(bk, bc, pend2), _fold(tk, tc, pend3)
            pend2, pend3, n_pending = [], [], 0
    return uni, _fold(bk, bc, pend2), _fold(tk, tc, pend3)


# ----------------------------------------------------------------------------- the model


class KatzTrigram:
    """Katz-backoff trigram over token ids; immutable after construction."""

    def __init__(self, vocab_size: int, fingerprint: str, arrays: dict[str, np.ndarray]):
        self.vocab_size = _check_vocab_size(vocab_size)
        self.fingerprint = str(fingerprint)
        _check_arrays(arrays, self.vocab_size)
        self._arrays = {name: np.ascontiguousarray(arrays[name], dt) for name, dt in _ARRAYS.items()}
        a = self._arrays
        self._unigram = a["unigram_probs"]  # [V]
        self._alpha2 = a["bigram_backoff"]  # [V]
        self._bi_keys, self._bi_probs = a["bigram_keys"], a["bigram_probs"]  # [B]
        self._bi_next = self._bi_keys % self.vocab_size  # [B] continuation ids
        self._ctx3, self._alpha3 = a["trigram_context_keys"], a["trigram_backoff"]  # [H]
        self._tri_keys, self._tri_probs = a["trigram_keys"], a["trigram_probs"]  # [T]
        self._tri_next = self._tri_keys % self.vocab_size  # [T] continuation ids

    @classmethod
    def build(cls, sequences: Iterable[Sequence[int]], vocab_size: int, fingerprint: str = "") -> "KatzTrigram":
        """Counts n-grams within each sequence (n-grams never cross sequence boundaries)."""
        v = _check_vocab_size(vocab_size)
        uni, (bk, bc), (tk, tc) = _count(sequences, v)
        return cls(v, fingerprint, _estimate(uni, bk, bc, tk, tc, v))

    # -- persistence

    def save(self, path: str | os.PathLike) -> None:
        """One .safetensors file; metadata holds format, version, vocab_size, fingerprint."""
        from safetensors.numpy import save_file

        path = Path(path).expanduser()
        meta = {
            "format": _FORMAT,
            "format_version": _FORMAT_VERSION,
            "vocab_size": str(self.vocab_size),
            "fingerprint": self.fingerprint,
            "discount_k": str(DISCOUNT_K),
        }
        if not path.parent.is_dir():
            raise SpecDecError(f"cannot write n-gram model to {path}: folder {path.parent} does not exist")
        tmp = path.with_name(path.name + ".tmp")
        try:
            save_file(self._arrays, str(tmp), metadata=meta)
            os.replace(tmp, path)
        except OSError as e:
            raise SpecDecError(f"cannot write n-gram model to {path}: {e}") from e

    @classmethod
    def load(cls, path: str | os.PathLike) -> "KatzTrigram":
        """Reads a file written by `save`; SpecDecError naming the path on any problem."""
        from safetensors import safe_open

        path = Path(path).expanduser()
        if not path.is_file():
            raise SpecDecError(f"n-gram model file not found: {path}")
        try:
            with safe_open(str(path), framework="np") as f:
                meta = f.metadata() or {}
                arrays = {name: f.get_tensor(name) for name in f.keys()}
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise SpecDecError(f"{path} is not a readable safetensors file: {e}") from e
        if meta.get("format") != _FORMAT or meta.get("format_version") != _FORMAT_VERSION:
            raise SpecDecError(
                f"{path} is not a specdec Katz trigram model (format {meta.get('format')!r} "
                f"version {meta.get('format_version')!r}; expected {_FORMAT!r} version {_FORMAT_VERSION})"
            )
        try:
            return cls(int(meta.get("vocab_size", "")), meta.get("fingerprint", ""), arrays)
        except (SpecDecError, ValueError) as e:
            raise SpecDecError(f"{path}: corrupt n-gram model: {e}") from e

    # -- queries

    def next_token_probs(self, context: Sequence[int]) -> torch.Tensor:
        """P(· | last ≤ 2 ids of context) as float32 [V]; non-negative, sums to 1."""
        return torch.from_numpy(self._probs(*self._last_two(context)))

    def log_probs(self, context: Sequence[int]) -> torch.Tensor:
        """log of next_token_probs, float32 [V]; -inf where the probability is 0."""
        return torch.log(self.next_token_probs(context))

    def top_token(self, context: Sequence[int]) -> int:
        """Most probable next id (smallest id among ties)."""
        return int(np.argmax(self._probs(*self._last_two(context))))

    def _last_two(self, context: Sequence[int]) -> tuple[int | None, int | None]:
        """(a, b) = the last two ids, None where the context is shorter; checked in [0, V)."""
        tail = context[-2:]
        try:
            ids = [operator.index(x) for x in tail]
        except TypeError as e:
            raise SpecDecError(f"context must hold integer token ids: {e}") from e
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise SpecDecError(f"token id {i} is outside the n-gram vocabulary [0, {self.vocab_size})")
        ids = [None] * (2 - len(ids)) + ids
        return ids[0], ids[1]

    def _probs(self, a: int | None, b: int | None) -> np.ndarray:
        """Dense float32 [V]: alpha3*alpha2*P1, then bigram seen ids, then trigram seen ids."""
        v = self.vocab_size
        if b is None:
            return self._unigram.copy()  # [V]
        blo, bhi = np.searchsorted(self._bi_keys, (b * v, (b + 1) * v))
        alpha2 = self._alpha2[b]  # 1 when b has no seen continuation
        alpha3, tlo, thi = np.float32(1.0), 0, 0
        if a is not None:
            h = a * v + b
            i = int(np.searchsorted(self._ctx3, h))
            if i < len(self._ctx3) and self._ctx3[i] == h:  # else unseen history: alpha3 = 1
                alpha3 = self._alpha3[i]
                tlo, thi = np.searchsorted(self._tri_keys, (h * v, (h + 1) * v))
        probs = self._unigram * (alpha2 * alpha3)  # [V]
        probs[self._bi_next[blo:bhi]] = self._bi_probs[blo:bhi] * alpha3
        probs[self._tri_next[tlo:thi]] = self._tri_probs[tlo:thi]
        return probs


# ----------------------------------------------------------------------------- validation


def _check_vocab_size(vocab_size: int) -> int:
    try:
        v = operator.index(vocab_size)
    except TypeError as e:
        raise SpecDecError(f"vocab_size must be an integer, got {vocab_size!r}") from e
    if not 1 <= v <= _MAX_VOCAB:
        raise SpecDecError(f"vocab_size must be in [1, {_MAX_VOCAB}], got {v}")
    return v


def _check_arrays(arrays: dict[str, np.ndarray], v: int) -> None:
    """Names, dtypes, shapes and key ranges/orders that the query code relies on."""
    missing = sorted(set(_ARRAYS) - set(arrays))
    if missing:
        raise SpecDecError(f"missing arrays {missing}")
    for name, dtype in _ARRAYS.items():
        if arrays[name].dtype != dtype or arrays[name].ndim != 1:
            got = f"{arrays[name].dtype}{list(arrays[name].shape)}"
            raise SpecDecError(f"array {name} must be 1-D {np.dtype(dtype)}, got {got}")
    shapes = [("unigram_probs", "bigram_backoff"), ("bigram_keys", "bigram_probs"),
              ("trigram_context_keys", "trigram_backoff"), ("trigram_keys", "trigram_probs")]
    for x, y in shapes:
        if len(arrays[x]) != len(arrays[y]):
            raise SpecDecError(f"arrays {x} and {y} differ in length")
    if len(arrays["unigram_probs"]) != v:
        raise SpecDecError(f"unigram_probs has {len(arrays['unigram_probs'])} entries, vocab_size is {v}")
    for name, limit in [("bigram_keys", v**2), ("trigram_context_keys", v**2), ("trigram_keys", v**3)]:
        keys = arrays[name]
        if len(keys) and (keys[0] < 0 or keys[-1] >= limit or np.any(np.diff(keys) <= 0)):
            raise SpecDecError(f"{name} must be strictly increasing and in [0, {limit})")


# ----------------------------------------------------------------------------- files


def build_from_files(
    paths: Sequence[str | os.PathLike], tokenizer, fingerprint: str = "", progress: bool = True
) -> KatzTrigram:
    """Builds from text files (utf-8, errors='replace'), one token sequence per file.

    Each file is tokenized with `tokenizer.encode(text, add_special_tokens=False)`;
    vocab_size = len(tokenizer).
    """
    paths = [Path(p) for p in paths]
    if not paths:
        raise SpecDecError("no text files given to build the n-gram model from")
    for p in paths:  # fail before spending time on tokenization
        if not p.is_file():
            raise SpecDecError(f"text file not found: {p}")
    return KatzTrigram.build(_tokenized_files(paths, tokenizer, progress), len(tokenizer), fingerprint)


def _tokenized_files(paths: list[Path], tokenizer, progress: bool) -> Iterator[list[int]]:
    from tqdm import tqdm

    for p in tqdm(paths, desc="n-gram counts", unit="file", disable=not progress):
        try:
            text = p.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise SpecDecError(f"cannot read text file {p}: {e}") from e
        yield tokenizer.encode(text, add_special_tokens=False)
