"""Generated text as it reads after the prompt (`specdec.text`): decoded a window at a time as ids arrive
(`GrowingText`), it is the text of decoding every id at once, for tokenizers of every decoding kind."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import specdec
from specdec.text import GrowingText, continuation_decoder
from tiny import make_tokenizer

SAMPLE = ("def area(r):\n    return 3.14159 * r ** 2  # π r²\n\nZürich, naïve café — “quoted”, 東京 and emoji 🙂.\n"
          "The model's answer isn't final; it's drafted, then checked.   Spaces   and\ttabs.\n") * 3


def demo_tokenizer():
    """Byte-level BPE (Llama 3's, Qwen's kind): the demo pair's."""
    return AutoTokenizer.from_pretrained(Path(specdec.__file__).parent / "demo_pair" / "target")


def sentencepiece_like():
    """A Metaspace word-piece tokenizer with byte fallback (Llama 2's, Gemma's kind): a leading space
    dropped at the start of the text, characters outside its vocabulary as bytes."""
    pieces = ["<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + sorted(set("▁" + SAMPLE.replace(" ", "▁")) - {"\n"})
    pieces += ["▁the", "▁and", "re", "ed", "in", "▁r", "▁model", "er", "at", "on"]
    backend = Tokenizer(models.BPE(vocab={piece: i for i, piece in enumerate(pieces)}, merges=[], unk_token="<unk>",
                                   byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


TOKENIZERS = {"byte-level BPE": demo_tokenizer, "SentencePiece-like": sentencepiece_like, "characters": make_tokenizer}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tokenizer(request):
    return TOKENIZERS[request.param]()


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_text_decoded_a_window_at_a_time_is_the_whole_decode(tokenizer, data):
    """Ids of real text or drawn at random (broken characters, bytes, specials), arriving in steps of
    any size: the text after every step is `continuation_decoder`'s of all the ids so far."""
    encoded = tokenizer.encode(SAMPLE, add_special_tokens=False)
    if data.draw(st.booleans(), label="random ids"):
        ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), min_size=100, max_size=300), label="ids")
    else:
        start = data.draw(st.integers(0, len(encoded) - 100), label="start")
        ids = encoded[start:start + 300]
    prompt = encoded[:data.draw(st.integers(0, 8), label="prompt")]
    growing, whole = GrowingText(tokenizer, prompt), continuation_decoder(tokenizer, prompt)
    count = 0
    while count < len(ids):
        count = min(len(ids), count + data.draw(st.integers(1, 40), label="step"))
        assert growing.text(ids[:count]) == whole(ids[:count])
    assert growing.text(ids[: count // 2]) == whole(ids[: count // 2])  # a prefix (a stop string's cut)


@settings(max_examples=40, deadline=None)
@given(st.integers(20, 40), st.lists(st.integers(1, 6), min_size=1, max_size=8), st.booleans())
def test_a_run_of_byte_tokens_is_never_split(count, steps, dangling):
    """A byte-fallback decoder reads a run of byte tokens whole: one invalid byte at its end (a generation
    cut mid-character) turns every character of the run into U+FFFD, so no split may fall inside a run."""
    tokenizer = sentencepiece_like()
    byte = [tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)]
    ids = [byte[b] for b in "".join(chr(0x1F600 + i % 40) for i in range(count)).encode()]  # not in its vocabulary
    ids += [byte[0xF0]] if dangling else tokenizer.encode(" the end", add_special_tokens=False)
    prompt = tokenizer.encode("said the model", add_special_tokens=False)
    growing, whole = GrowingText(tokenizer, prompt), continuation_decoder(tokenizer, prompt)
    fed = 0
    for step in (steps * len(ids))[: len(ids)]:
        fed = min(len(ids), fed + step)
        assert growing.text(ids[:fed]) == whole(ids[:fed])


def test_most_of_a_long_text_is_decoded_once():
    """After 1,000 ids a step decodes at most 4 windows of them (`GrowingText.WINDOW`), not all of them."""
    tokenizer = demo_tokenizer()
    ids = tokenizer.encode(SAMPLE * 10, add_special_tokens=False)[:1000]
    growing = GrowingText(tokenizer, [])
    for count in range(1, len(ids) + 1):
        growing.text(ids[:count])
    assert len(ids) - growing._fixed <= 4 * GrowingText.WINDOW
    assert growing.text(ids) == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_tokenizer_that_cleans_up_spaces_is_decoded_whole():
    """Its clean-up (" ." reads ".") reaches back across any split: nothing is fixed."""
    tokenizer = make_tokenizer()
    tokenizer.clean_up_tokenization_spaces = True
    ids = tokenizer.encode("a b . c " * 40, add_special_tokens=False)
    growing = GrowingText(tokenizer, [])
    for count in range(1, len(ids) + 1):
        assert growing.text(ids[:count]) == tokenizer.decode(ids[:count], skip_special_tokens=True)
    assert growing._fixed == 0
