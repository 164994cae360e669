"""Tests for specdec.katz: Katz-backoff trigram checked against an independent dict-based reference."""

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import specdec.katz as ngram
from specdec.errors import SpecDecError
from specdec.katz import KatzTrigram, build_from_files, katz_discounts

K = 5
EPS = 1e-9


# ----------------------------------------------------------------------------- slow reference


def ref_discounts(counter: Counter) -> dict[int, float]:
    """Katz d_r for r = 1..K from plain counts; absolute-discount fallback as documented."""
    n = Counter(counter.values())
    n1, n2 = n[1], n[2]
    big_d = n1 / (n1 + 2 * n2) if n1 and n2 else 0.5
    a = (K + 1) * n[K + 1] / n1 if n1 else float("inf")
    d = {}
    for r in range(1, K + 1):
        katz = None
        if a < 1 and n[r]:
            katz = ((r + 1) * n[r + 1] / n[r] / r - a) / (1 - a)
        d[r] = katz if katz is not None and 0 < katz <= 1 else (r - big_d) / r
    return d


class RefKatz:
    """Plain-dict Katz backoff; backoff denominators summed over the *unseen* words."""

    def __init__(self, seqs, v):
        self.v = v
        self.c1, self.c2, self.c3 = Counter(), Counter(), Counter()
        for s in seqs:
            self.c1.update(s)
            self.c2.update(zip(s, s[1:]))
            self.c3.update(zip(s, s[1:], s[2:]))
        total = sum(self.c1.values())
        self.p1 = {w: (self.c1[w] + 1) / (total + v) for w in range(v)}
        self.d2, self.d3 = ref_discounts(self.c2), ref_discounts(self.c3)

    def _katz(self, seen_counts: dict, d: dict, lower: dict) -> dict:
        if not seen_counts:
            return dict(lower)
        hist = sum(seen_counts.values())
        seen = {w: (d[r] if r <= K else 1.0) * r / hist for w, r in seen_counts.items()}
        num = 1 - sum(seen.values())
        den = sum(p for w, p in lower.items() if w not in seen)
        if num <= EPS or den <= EPS:
            s = sum(seen.values())
            return {w: seen.get(w, 0.0) / s for w in range(self.v)}
        return {w: seen[w] if w in seen else num / den * lower[w] for w in range(self.v)}

    def bigram(self, b) -> dict:
        seen = {w: r for (x, w), r in self.c2.items() if x == b}
        return self._katz(seen, self.d2, self.p1)

    def trigram(self, a, b) -> dict:
        seen = {w: r for (x, y, w), r in self.c3.items() if (x, y) == (a, b)}
        return self._katz(seen, self.d3, self.bigram(b))

    def dist(self, context) -> np.ndarray:
        ctx = list(context)[-2:]
        if len(ctx) == 2:
            p = self.trigram(*ctx)
        else:
            p = self.bigram(ctx[0]) if ctx else self.p1
        return np.array([p[w] for w in range(self.v)])


def all_contexts(v):
    return [[]] + [[b] for b in range(v)] + [[a, b] for a in range(v) for b in range(v)]


def assert_matches_reference(seqs, v):
    model, ref = KatzTrigram.build(seqs, v), RefKatz(seqs, v)
    for ctx in all_contexts(v):
        got = model.next_token_probs(ctx).numpy().astype(np.float64)
        np.testing.assert_allclose(got, ref.dist(ctx), rtol=1e-5, atol=1e-7, err_msg=f"context {ctx}")


def markov_corpus(v, n_seqs, length, seed):
    """Skewed Markov-chain sequences: plenty of repeated n-grams, counts both <= 5 and > 5."""
    rng = np.random.default_rng(seed)
    trans = rng.dirichlet(np.full(v, 0.3), size=v)
    seqs = []
    for _ in range(n_seqs):
        s = [int(rng.integers(v))]
        for _ in range(length - 1):
            s.append(int(rng.choice(v, p=trans[s[-1]])))
        seqs.append(s)
    return seqs


# ----------------------------------------------------------------------------- discounts and hand values


def test_katz_discounts_by_hand():
    # n1=10 n2=4 n3=3 n4=2 n5=1 n6=1  ->  A = 6*1/10 = 0.6, fallback D = 10/(10+2*4) = 5/9
    counts = np.array([1] * 10 + [2] * 4 + [3] * 3 + [4] * 2 + [5] + [6])
    d = katz_discounts(counts)
    assert d[1] == pytest.approx(0.5)  # r* = 0.8; (0.8 - 0.6)/0.4
    assert d[2] == pytest.approx((2 - 5 / 9) / 2)  # Katz gives 1.3125 > 1 -> fallback
    assert d[3] == pytest.approx(13 / 18)  # r*/r = 8/9; (8/9 - 3/5)/(2/5)
    assert d[4] == pytest.approx(0.0625)  # r*/r = 0.625
    assert d[5] == pytest.approx((5 - 5 / 9) / 5)  # Katz gives 1.5 -> fallback


def test_probabilities_by_hand():
    # corpus 0 1 0 1 2, V = 4 (id 3 never seen). Worked out in the comments.
    m = KatzTrigram.build([[0, 1, 0, 1, 2]], 4)
    p = lambda ctx: m.next_token_probs(ctx).numpy().astype(np.float64)  # noqa: E731
    # unigram add-one: counts (2, 2, 1, 0), N = 5 -> (3, 3, 2, 1)/9
    np.testing.assert_allclose(p([]), np.array([3, 3, 2, 1]) / 9, rtol=1e-6)
    # bigram counts 2,1,1: n1=2 n2=1 -> d1 = 1 (Katz), d2 = fallback (2 - 1/2)/2 = 0.75.
    # P(1|0) = 0.75, alpha(0) = 0.25 / (1 - 3/9) = 0.375
    np.testing.assert_allclose(p([0]), [0.125, 0.75, 1 / 12, 1 / 24], rtol=1e-6)
    # after 1: 0 and 2 once each, undiscounted -> nothing left over, alpha(1) = 0
    np.testing.assert_allclose(p([1]), [0.5, 0, 0.5, 0], atol=1e-7)
    # nothing seen after 2 -> unigram
    np.testing.assert_allclose(p([2]), p([]), rtol=1e-6)
    # trigram counts all 1: n2 = 0 -> d1 = fallback 1/2.
    # (1,0): P(1|1,0) = 0.5; lower P(1|0) = 0.75 -> alpha = 0.5/0.25 = 2 -> 2 * P(.|0) elsewhere
    np.testing.assert_allclose(p([1, 0]), [0.25, 0.5, 1 / 6, 1 / 12], rtol=1e-6)
    # (0,1): seen 0, 2 at 0.25 each, but the bigram gives no mass outside {0, 2}: renormalised
    np.testing.assert_allclose(p([0, 1]), [0.5, 0, 0.5, 0], atol=1e-7)
    # unseen trigram histories back off entirely; longer contexts use the last two ids
    np.testing.assert_allclose(p([3, 0]), p([0]), rtol=1e-6)
    np.testing.assert_allclose(p([2, 2, 1, 0]), p([1, 0]), rtol=1e-6)


# ----------------------------------------------------------------------------- against the reference


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_reference_markov_corpus(seed):
    assert_matches_reference(markov_corpus(6, n_seqs=5, length=60, seed=seed), 6)


def test_matches_reference_with_katz_branch_used():
    # larger corpus: both orders mix Katz's formula with the absolute-discount fallback
    seqs = markov_corpus(12, n_seqs=5, length=400, seed=2)
    for order in (2, 3):
        counts = Counter(t for s in seqs for t in zip(*(s[i:] for i in range(order))))
        n = Counter(counts.values())
        fallback = [(r - n[1] / (n[1] + 2 * n[2])) / r for r in range(1, K + 1)]
        is_fallback = np.isclose(katz_discounts(np.array(list(counts.values())))[1:], fallback)
        assert is_fallback.any() and not is_fallback.all(), (order, is_fallback)
    assert_matches_reference(seqs, 12)


@settings(max_examples=60, deadline=None)
@given(
    v=st.integers(1, 5),
    data=st.data(),
)
def test_matches_reference_random_corpora(v, data):
    seqs = data.draw(st.lists(st.lists(st.integers(0, v - 1), max_size=25), max_size=6))
    assert_matches_reference(seqs, v)


def test_degenerate_trigram_history_is_renormalised():
    # bigram (1,2) seen 6 times (> k: undiscounted, alpha(1) = 0); each trigram (x,1,2) once
    seqs = [[x, 1, 2] for x in (0, 3, 4, 5, 6, 7)]
    m = KatzTrigram.build(seqs, 8)
    for ctx in ([1], [0, 1], [7, 1]):
        p = m.next_token_probs(ctx)
        assert p[2].item() == pytest.approx(1.0)
        assert p.sum().item() == pytest.approx(1.0, abs=1e-6)
    assert_matches_reference(seqs, 8)


# ----------------------------------------------------------------------------- properties


@pytest.fixture(scope="module")
def mid_model():
    rng = np.random.default_rng(3)
    v = 500
    seqs = [rng.zipf(1.3, size=2000) % v for _ in range(5)]
    return KatzTrigram.build(seqs, v, fingerprint="fp-mid")


@settings(max_examples=150, deadline=None)
@given(ctx=st.lists(st.integers(0, 499), max_size=4))
def test_distributions_are_proper(mid_model, ctx):
    p = mid_model.next_token_probs(ctx)
    assert p.dtype == torch.float32 and p.shape == (500,)
    assert torch.isfinite(p).all() and (p >= 0).all()
    assert p.sum().item() == pytest.approx(1.0, abs=1e-5)
    assert mid_model.top_token(ctx) == int(torch.argmax(p))
    lp = mid_model.log_probs(ctx)
    assert lp.dtype == torch.float32
    assert torch.equal(torch.exp(lp)[p > 0], torch.exp(torch.log(p[p > 0])))


def test_context_types_agree(mid_model):
    ref = mid_model.next_token_probs([7, 1, 2])
    for ctx in ([1, 2], (1, 2), np.array([1, 2]), torch.tensor([9, 1, 2])):
        assert torch.equal(mid_model.next_token_probs(ctx), ref)


def test_top_token_follows_counts():
    # after 6: 8 dominates overall, but after (5, 6) it is always 7
    seqs = [[1, 6, 8]] * 10 + [[5, 6, 7]] * 3 + [[2, 6, 8]] * 2
    m = KatzTrigram.build(seqs, 10)
    assert m.top_token([6]) == 8
    assert m.top_token([1, 6]) == 8
    assert m.top_token([5, 6]) == 7
    assert m.top_token([9, 5, 6]) == 7
    assert m.top_token([]) == 6


def test_ngrams_do_not_cross_sequences():
    m = KatzTrigram.build([[0, 1], [2, 3]], 4)
    joined = KatzTrigram.build([[0, 1, 2, 3]], 4)
    assert m.next_token_probs([1])[2] < joined.next_token_probs([1])[2]
    assert torch.equal(m.next_token_probs([1]), m.next_token_probs([]))  # 1 never has a successor


def test_merging_in_chunks_gives_same_model(monkeypatch):
    seqs = markov_corpus(6, n_seqs=8, length=50, seed=11)
    whole = KatzTrigram.build(seqs, 6)
    monkeypatch.setattr(ngram, "_MERGE_EVERY", 7)
    chunked = KatzTrigram.build(iter(seqs), 6)
    for ctx in all_contexts(6):
        assert torch.equal(whole.next_token_probs(ctx), chunked.next_token_probs(ctx))


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("ctx", [[4], [-1], [0, 4], [0, 1, 99], [0.5]])
def test_bad_context_ids_raise(ctx):
    m = KatzTrigram.build([[0, 1, 2, 3]], 4)
    with pytest.raises(SpecDecError):
        m.next_token_probs(ctx)
    with pytest.raises(SpecDecError):
        m.top_token(ctx)


def test_bad_build_arguments_raise():
    with pytest.raises(SpecDecError, match="outside"):
        KatzTrigram.build([[0, 1, 5]], 4)
    with pytest.raises(SpecDecError):
        KatzTrigram.build([[0, -1]], 4)
    with pytest.raises(SpecDecError):
        KatzTrigram.build([[0.0, 1.0]], 4)
    for v in (0, -3, 10**7):
        with pytest.raises(SpecDecError, match="vocab_size"):
            KatzTrigram.build([[0]], v)


def test_empty_corpus_is_uniform():
    m = KatzTrigram.build([], 5)
    np.testing.assert_allclose(m.next_token_probs([1, 2]).numpy(), np.full(5, 0.2), rtol=1e-6)


# ----------------------------------------------------------------------------- persistence


def test_save_load_round_trip(tmp_path, mid_model):
    path = tmp_path / "ngram.safetensors"
    mid_model.save(path)
    loaded = KatzTrigram.load(str(path))
    assert loaded.vocab_size == 500 and loaded.fingerprint == "fp-mid"
    rng = np.random.default_rng(0)
    for ctx in [[], [3]] + [list(rng.integers(0, 500, size=2)) for _ in range(50)] + [[1, 2]]:
        assert torch.equal(loaded.next_token_probs(ctx), mid_model.next_token_probs(ctx))


def test_load_missing_file(tmp_path):
    path = tmp_path / "nope.safetensors"
    with pytest.raises(SpecDecError, match="nope.safetensors"):
        KatzTrigram.load(path)


def test_load_garbage_and_truncated(tmp_path, mid_model):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"this is not a safetensors file at all" * 10)
    with pytest.raises(SpecDecError, match="garbage.safetensors"):
        KatzTrigram.load(garbage)
    good = tmp_path / "good.safetensors"
    mid_model.save(good)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(SpecDecError, match="truncated.safetensors"):
        KatzTrigram.load(truncated)


def test_load_wrong_format(tmp_path):
    from safetensors.numpy import save_file

    other = tmp_path / "other.safetensors"
    save_file({"weight": np.zeros(3, np.float32)}, str(other), metadata={"format": "pt"})
    with pytest.raises(SpecDecError, match="other.safetensors"):
        KatzTrigram.load(other)
    # right metadata, inconsistent arrays
    bad = tmp_path / "bad.safetensors"
    KatzTrigram.build([[0, 1, 2]], 3).save(bad)
    from safetensors import safe_open

    with safe_open(str(bad), "np") as f:
        meta, arrays = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    arrays["bigram_keys"] = arrays["bigram_keys"][::-1].copy()  # no longer sorted
    save_file(arrays, str(bad), metadata=meta)
    with pytest.raises(SpecDecError, match="bad.safetensors"):
        KatzTrigram.load(bad)


# ----------------------------------------------------------------------------- build_from_files


@pytest.fixture
def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "a": 1, "b": 2, "c": 3, "d": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def test_build_from_files(tmp_path, word_tokenizer):
    f1, f2 = tmp_path / "one.txt", tmp_path / "two.txt"
    f1.write_text("a b c a b c a b d")
    f2.write_bytes(b"c a \xff b")  # invalid utf-8 -> U+FFFD -> [UNK]
    m = build_from_files([f1, str(f2)], word_tokenizer, fingerprint="wl", progress=False)
    expected = KatzTrigram.build([[1, 2, 3, 1, 2, 3, 1, 2, 4], [3, 1, 0, 2]], 5)
    assert m.vocab_size == 5 and m.fingerprint == "wl"
    for ctx in all_contexts(5):
        assert torch.equal(m.next_token_probs(ctx), expected.next_token_probs(ctx))
    assert m.top_token([1]) == 2


def test_build_from_files_errors(tmp_path, word_tokenizer):
    with pytest.raises(SpecDecError, match="no text files"):
        build_from_files([], word_tokenizer, progress=False)
    ok = tmp_path / "ok.txt"
    ok.write_text("a b")
    with pytest.raises(SpecDecError, match="missing.txt"):
        build_from_files([ok, tmp_path / "missing.txt"], word_tokenizer, progress=False)
    with pytest.raises(SpecDecError):
        build_from_files([tmp_path], word_tokenizer, progress=False)  # a directory
