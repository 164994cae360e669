"""Bad input through the Python API: every user mistake is a SpecDecError with a useful message.

Corruption cases work on copies of the session fixture checkpoints (never on the fixtures).
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

import specdec
from specdec import SpecDecError
from specdec.katz import KatzTrigram
from specdec.runtime import tokenizer_fingerprint
from tiny import CHARS, VOCAB

CONTEXT = 64  # max_position_embeddings of every tiny fixture model


# ----------------------------------------------------------------------------- helpers


def save_char_tokenizer(directory: Path, vocab: dict[str, int]) -> PreTrainedTokenizerFast:
    """A character tokenizer built like tests/tiny.py's (no EOS), but over the given string -> id map."""
    backend = Tokenizer(models.BPE(vocab=dict(vocab), merges=[], unk_token=None))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.save_pretrained(directory)
    return tokenizer


def swapped_vocab(x: str = "a", y: str = "b") -> dict[str, int]:
    vocab = dict(VOCAB)
    vocab[x], vocab[y] = vocab[y], vocab[x]
    return vocab


def copy_checkpoint(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="module")
def decoder(model_dirs):
    return specdec.load(model_dirs["llama"], device="cpu")


@pytest.fixture(scope="module")
def swapped_draft(model_dirs, tmp_path_factory) -> Path:
    """The llama draft checkpoint with 'a' and 'b' swapped in its tokenizer."""
    directory = copy_checkpoint(model_dirs["llama-draft"], tmp_path_factory.mktemp("swapped") / "draft")
    save_char_tokenizer(directory, swapped_vocab("a", "b"))
    return directory


# ----------------------------------------------------------------------------- generation arguments


BAD_ARGUMENTS = {
    "empty-prompt": ("", {}, r"the prompt is empty"),
    "empty-id-list": ([], {}, r"the prompt is empty"),
    "prompt-fills-context": ("a" * CONTEXT, {}, rf"the prompt has {CONTEXT} tokens; the context holds {CONTEXT}"),
    "prompt-beyond-context": ("a" * (CONTEXT + 10), {}, rf"the prompt has {CONTEXT + 10} tokens; the context holds {CONTEXT}"),
    "id-prompt-fills-context": ([1] * CONTEXT, {}, rf"the prompt has {CONTEXT} tokens"),
    "id-too-large": ([1, 2, 16], {}, r"prompt token ids must be in \[0, 16\)"),
    "id-negative": ([1, -1], {}, r"prompt token ids must be in \[0, 16\)"),
    "temperature-negative": ("ab", {"temperature": -0.5}, r"temperature must be >= 0, got -0.5"),
    "temperature-nan": ("ab", {"temperature": float("nan")}, r"temperature must be >= 0"),
    "temperature-inf": ("ab", {"temperature": float("inf")}, r"temperature must be >= 0"),
    "top-p-zero": ("ab", {"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0"),
    "top-p-negative": ("ab", {"top_p": -0.1}, r"top_p must be in \(0, 1\]"),
    "top-p-above-one": ("ab", {"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
    "top-p-nan": ("ab", {"top_p": float("nan")}, r"top_p must be in \(0, 1\]"),
    "top-k-negative": ("ab", {"top_k": -1}, r"top_k must be an integer >= 0"),
    "top-k-float": ("ab", {"top_k": 2.5}, r"top_k must be an integer >= 0"),
    "max-new-tokens-negative": ("ab", {"max_new_tokens": -1}, r"max_new_tokens must be an integer >= 0, got -1"),
    "max-new-tokens-float": ("ab", {"max_new_tokens": 2.5}, r"max_new_tokens must be an integer >= 0"),
    "empty-stop-string": ("ab", {"stop": [""]}, r"stop strings must be non-empty"),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_generation_arguments(decoder, case):
    prompt, options, match = BAD_ARGUMENTS[case]
    with pytest.raises(SpecDecError, match=match):
        decoder.generate(prompt, **options)


def test_stream_validates_before_the_first_delta(decoder):
    """The error comes from stream() itself, not from the first next(): a server can answer 4xx early."""
    with pytest.raises(SpecDecError, match="the prompt is empty"):
        decoder.stream("")
    with pytest.raises(SpecDecError, match="temperature"):
        decoder.stream("ab", temperature=-1)


def test_spec_dec_error_is_a_value_error():
    assert issubclass(SpecDecError, ValueError)
    assert specdec.SpecDecError is SpecDecError


def test_prompt_that_fills_all_but_one_position_is_allowed(decoder):
    result = decoder.generate("a" * (CONTEXT - 1), max_new_tokens=8, temperature=0)
    assert len(result.tokens) == 1 and result.finish_reason == "length"


def test_zero_new_tokens_is_allowed(decoder):
    result = decoder.generate("ab", max_new_tokens=0, temperature=0)
    assert result.tokens == [] and result.text == ""


@pytest.mark.parametrize("drafter", ["draft", "prompt_lookup"])
def test_generation_stops_at_the_context_end_with_a_drafter(model_dirs, drafter):
    """More new tokens than the context has room for: generation ends at the context, no error."""
    options = {"draft": model_dirs["llama-draft"]} if drafter == "draft" else {"prompt_lookup": True}
    decoder = specdec.load(model_dirs["llama"], device="cpu", gamma=4, **options)
    prompt = "abcabcabc" * 6 + "ab"  # 56 tokens: room for 8
    for temperature in (0, 1):
        result = decoder.generate(prompt, max_new_tokens=20, temperature=temperature, seed=0)
        assert len(result.tokens) == CONTEXT - len(prompt)
        assert result.finish_reason == "length"


def test_draft_with_shorter_context_stops_drafting_but_not_generation(model_dirs, tmp_path):
    """Only the target's context limits the prompt; past its own context the draft model proposes nothing."""
    draft = copy_checkpoint(model_dirs["llama-draft"], tmp_path / "short-draft")
    config = json.loads((draft / "config.json").read_text())
    config["max_position_embeddings"] = 16
    (draft / "config.json").write_text(json.dumps(config))
    decoder = specdec.load(model_dirs["llama"], draft=str(draft), device="cpu", gamma=3)
    result = decoder.generate("a" * 20, max_new_tokens=10, temperature=0)
    plain = specdec.SpeculativeDecoder(decoder.target).generate("a" * 20, max_new_tokens=10, temperature=0)
    assert result.tokens == plain.tokens and len(result.tokens) == 10
    assert result.stats.drafted == 0
    auto = specdec.load(model_dirs["llama"], draft=str(draft), device="cpu").generate("a" * 20, max_new_tokens=10, temperature=0)
    assert auto.tokens == plain.tokens and auto.stats.draft_forwards == 0  # prompt lookup may still draft


# ----------------------------------------------------------------------------- checkpoints


def _no_config(d: Path):
    (d / "config.json").unlink()


def _invalid_json_config(d: Path):
    (d / "config.json").write_text('{"model_type": "llama", ')


def _empty_config(d: Path):
    (d / "config.json").write_text("")


def _config_without_model_type(d: Path):
    (d / "config.json").write_text("{}")


def _truncated_weights(d: Path):
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])


def _garbage_weights(d: Path):
    (d / "model.safetensors").write_bytes(b"this is not a safetensors file" * 50)


def _empty_weights_file(d: Path):
    (d / "model.safetensors").write_bytes(b"")


def _wrong_shapes(d: Path):
    config = json.loads((d / "config.json").read_text())
    config["intermediate_size"] = config["intermediate_size"] * 2  # weights no longer fit the config
    (d / "config.json").write_text(json.dumps(config))


def _no_tokenizer(d: Path):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (d / name).unlink(missing_ok=True)


def _corrupt_tokenizer(d: Path):
    (d / "tokenizer.json").write_text("{not json")


CORRUPTIONS = [
    (_no_config, r"has no config\.json"),
    (_invalid_json_config, r"config\.json is not valid JSON"),
    (_empty_config, r"config\.json is not valid JSON"),
    (_config_without_model_type, r"could not load the model in .*ckpt"),
    (_truncated_weights, r"could not load the model in .*ckpt.*(Safetensor|header)"),
    (_garbage_weights, r"could not load the model in .*ckpt.*(Safetensor|header)"),
    (_empty_weights_file, r"could not load the model in .*ckpt.*(Safetensor|header)"),
    (_wrong_shapes, r"could not load the model in .*ckpt"),
    (_no_tokenizer, r"has no tokenizer files"),
    (_corrupt_tokenizer, r"could not load the model in .*ckpt"),
]


@pytest.mark.parametrize("corrupt, match", CORRUPTIONS, ids=[f.__name__.strip("_") for f, _ in CORRUPTIONS])
def test_corrupt_checkpoint(model_dirs, tmp_path, corrupt, match):
    directory = copy_checkpoint(model_dirs["llama"], tmp_path / "ckpt")
    corrupt(directory)
    with pytest.raises(SpecDecError, match=match):
        specdec.load_model(directory, device="cpu")
    with pytest.raises(SpecDecError, match=match):
        specdec.load(str(directory), device="cpu")


def test_corrupt_draft_checkpoint(model_dirs, tmp_path):
    draft = copy_checkpoint(model_dirs["llama-draft"], tmp_path / "draft")
    _truncated_weights(draft)
    with pytest.raises(SpecDecError, match=r"could not load the model in .*draft"):
        specdec.load(model_dirs["llama"], draft=str(draft), device="cpu")


class _WouldRun:
    """Unpickling this creates `path`: proof that someone unpickled the file."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_pickled_weights_are_refused_and_never_unpickled(model_dirs, tmp_path):
    directory = copy_checkpoint(model_dirs["llama"], tmp_path / "pickled")
    (directory / "model.safetensors").unlink()
    sentinel = tmp_path / "UNPICKLED"
    (directory / "pytorch_model.bin").write_bytes(pickle.dumps(_WouldRun(sentinel)))
    with pytest.raises(SpecDecError, match=r"no \.safetensors weights.*pytorch_model\.bin.*never loaded"):
        specdec.load_model(directory, device="cpu")
    with pytest.raises(SpecDecError, match=r"pytorch_model\.bin"):
        specdec.load(model_dirs["llama"], draft=str(directory), device="cpu")
    assert not sentinel.exists()


def test_no_weights_at_all(model_dirs, tmp_path):
    directory = copy_checkpoint(model_dirs["llama"], tmp_path / "noweights")
    (directory / "model.safetensors").unlink()
    with pytest.raises(SpecDecError, match=r"has no \.safetensors weights"):
        specdec.load_model(directory, device="cpu")


@pytest.mark.parametrize("keep", ["none", "first-layer-only"])
def test_safetensors_missing_weights_is_refused(model_dirs, tmp_path, keep):
    from safetensors.torch import load_file, save_file

    directory = copy_checkpoint(model_dirs["llama"], tmp_path / "missing-weights")
    weights = load_file(str(directory / "model.safetensors"))
    weights = {} if keep == "none" else {k: v for k, v in weights.items() if "layers.1." not in k}
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SpecDecError, match=r"missing|weights"):
        specdec.load_model(directory, device="cpu")


def test_missing_directory(tmp_path):
    with pytest.raises(SpecDecError, match=r"model not found: .*nowhere"):
        specdec.load_model(tmp_path / "nowhere", device="cpu")
    with pytest.raises(SpecDecError, match=r"model not found: .*nowhere"):
        specdec.load(str(tmp_path / "nowhere"), device="cpu")


def test_a_file_is_not_a_checkpoint_directory(model_dirs):
    with pytest.raises(SpecDecError, match=r"config.json is a file, not a checkpoint directory"):
        specdec.load_model(Path(model_dirs["llama"]) / "config.json", device="cpu")


def test_missing_draft_directory(model_dirs, tmp_path):
    with pytest.raises(SpecDecError, match=r"model not found: .*nodraft"):
        specdec.load(model_dirs["llama"], draft=str(tmp_path / "nodraft"), device="cpu")


def test_unknown_dtype(model_dirs):
    with pytest.raises(SpecDecError, match=r"unknown dtype 'int8'"):
        specdec.load_model(model_dirs["llama"], device="cpu", dtype="int8")


@pytest.mark.parametrize("gamma", [0, -1, 1.5, "x", True, None])
def test_bad_gamma(model_dirs, gamma):
    with pytest.raises(SpecDecError, match=r"gamma must be a positive integer or 'auto'"):
        specdec.load(model_dirs["llama"], prompt_lookup=True, gamma=gamma, device="cpu")


# ----------------------------------------------------------------------------- drafters


def test_draft_with_a_different_tokenizer_is_refused(model_dirs, swapped_draft):
    with pytest.raises(SpecDecError, match=r"does not match the target's: token 'a' has id 1 in the target but has id 2"):
        specdec.load(model_dirs["llama"], draft=str(swapped_draft), device="cpu")


def test_draft_missing_a_token_is_refused(model_dirs, tmp_path):
    draft = copy_checkpoint(model_dirs["llama-draft"], tmp_path / "draft")
    vocab = {token: i for token, i in VOCAB.items() if token != "n"}  # the last id
    save_char_tokenizer(draft, vocab)
    with pytest.raises(SpecDecError, match=rf"token 'n' has id {VOCAB['n']} in the target but is missing"):
        specdec.load(model_dirs["llama"], draft=str(draft), device="cpu")


def test_draft_with_extra_tokens_is_refused(model_dirs, tmp_path):
    draft = copy_checkpoint(model_dirs["llama-padded"], tmp_path / "draft")  # 24 rows: room for a 17th token
    save_char_tokenizer(draft, {**VOCAB, "z": len(VOCAB)})
    with pytest.raises(SpecDecError, match=rf"tokens the target lacks, first 'z' \(id {len(VOCAB)}\)"):
        specdec.load(model_dirs["llama"], draft=str(draft), device="cpu")


def test_tokenizer_larger_than_the_model_is_refused(model_dirs, tmp_path):
    directory = copy_checkpoint(model_dirs["llama"], tmp_path / "small-model")  # 16 output rows
    save_char_tokenizer(directory, {**VOCAB, "z": len(VOCAB)})
    with pytest.raises(SpecDecError, match=r"16 output rows but its tokenizer has 17 tokens"):
        specdec.load_model(directory, device="cpu")


def test_padded_draft_with_the_same_tokenizer_works(model_dirs):
    plain = specdec.load(model_dirs["llama"], device="cpu")
    padded = specdec.load(model_dirs["llama"], draft=model_dirs["llama-padded"], device="cpu", gamma=3)
    assert padded.drafter.model.model.get_output_embeddings().weight.shape[0] == 24
    expected = plain.generate("abcab", max_new_tokens=12, temperature=0)
    got = padded.generate("abcab", max_new_tokens=12, temperature=0)
    assert got.tokens == expected.tokens and got.text == expected.text
    assert got.stats.drafted > 0 and got.stats.draft_forwards > 0
    sampled = padded.generate("abcab", max_new_tokens=12, temperature=1, seed=3)
    assert len(sampled.tokens) == 12 and all(0 <= t < len(VOCAB) for t in sampled.tokens)
    assert set(sampled.text) <= set(CHARS + "<|endoftext|>")


def test_padded_target_works(model_dirs):
    decoder = specdec.load(model_dirs["llama-padded"], prompt_lookup=True, device="cpu")
    result = decoder.generate("abcabc", max_new_tokens=10, temperature=1, seed=0)
    assert len(result.tokens) == 10 and all(0 <= t < len(VOCAB) for t in result.tokens)


@pytest.mark.parametrize(
    "choice",
    [
        {"draft": "D", "ngram": "N"},
        {"draft": "D", "prompt_lookup": True},
        {"ngram": "N", "prompt_lookup": True},
        {"draft": "D", "ngram": "N", "prompt_lookup": True},
    ],
    ids=lambda c: "+".join(c),
)
def test_two_drafters_at_once(model_dirs, tmp_path, choice):
    paths = {"D": model_dirs["llama-draft"], "N": str(tmp_path / "missing.safetensors")}
    options = {k: paths.get(v, v) for k, v in choice.items()}
    with pytest.raises(SpecDecError, match=r"choose at most one"):
        specdec.load(model_dirs["llama"], device="cpu", gamma=3, **options)


@pytest.fixture(scope="module")
def foreign_ngram(tmp_path_factory) -> Path:
    """An n-gram file built with the swapped tokenizer's fingerprint (same vocabulary size)."""
    root = tmp_path_factory.mktemp("foreign-ngram")
    tokenizer = save_char_tokenizer(root / "tokenizer", swapped_vocab("a", "b"))
    ids = tokenizer.encode("abcdefghijklm n" * 4, add_special_tokens=False)
    path = root / "foreign.safetensors"
    KatzTrigram.build([ids], len(tokenizer), tokenizer_fingerprint(tokenizer)).save(path)
    return path


def test_ngram_from_another_tokenizer_is_refused(model_dirs, foreign_ngram):
    with pytest.raises(SpecDecError, match=r"built with another tokenizer than the target's \(fingerprint"):
        specdec.load(model_dirs["llama"], ngram=str(foreign_ngram), device="cpu")


def test_ngram_with_the_right_fingerprint_loads(model_dirs, load64, tmp_path):
    tokenizer = load64(model_dirs["llama"]).tokenizer
    path = tmp_path / "ok.safetensors"
    KatzTrigram.build([[1, 2, 3, 1, 2, 3]], len(tokenizer), tokenizer_fingerprint(tokenizer)).save(path)
    decoder = specdec.load(model_dirs["llama"], ngram=str(path), device="cpu")
    assert len(decoder.generate("abc", max_new_tokens=6, temperature=0).tokens) == 6


def test_ngram_with_another_vocabulary_size_is_refused(model_dirs, tmp_path):
    path = tmp_path / "v17.safetensors"
    KatzTrigram.build([[1, 2, 3]], len(VOCAB) + 1).save(path)
    with pytest.raises(SpecDecError, match=r"covers 17 tokens; the target's tokenizer has 16"):
        specdec.load(model_dirs["llama"], ngram=str(path), device="cpu")


def test_missing_or_corrupt_ngram_file(model_dirs, tmp_path):
    with pytest.raises(SpecDecError, match=r"n-gram model file not found"):
        specdec.load(model_dirs["llama"], ngram=str(tmp_path / "none.safetensors"), device="cpu")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00garbage" * 20)
    with pytest.raises(SpecDecError, match=r"garbage\.safetensors is not a readable safetensors file"):
        specdec.load(model_dirs["llama"], ngram=str(garbage), device="cpu")
    weights = Path(model_dirs["llama"]) / "model.safetensors"  # a safetensors file, but not an n-gram model
    with pytest.raises(SpecDecError, match=r"is not a specdec Katz trigram model"):
        specdec.load(model_dirs["llama"], ngram=str(weights), device="cpu")


# ----------------------------------------------------------------------------- seeds


@pytest.fixture(scope="module")
def draft_decoder(model_dirs):
    return specdec.load(model_dirs["llama"], draft=model_dirs["llama-draft"], device="cpu", gamma=3)


def test_same_seed_same_output_with_a_draft_model(draft_decoder):
    first = draft_decoder.generate("abc", max_new_tokens=16, temperature=1.0, seed=1234)
    second = draft_decoder.generate("abc", max_new_tokens=16, temperature=1.0, seed=1234)
    assert first.tokens == second.tokens and first.text == second.text
    assert first.stats.drafted > 0
    streamed = "".join(draft_decoder.stream("abc", max_new_tokens=16, temperature=1.0, seed=1234))
    assert streamed == first.text


def test_different_seeds_usually_differ(draft_decoder):
    outputs = {tuple(draft_decoder.generate("abc", max_new_tokens=16, temperature=1.0, seed=s).tokens) for s in range(6)}
    assert len(outputs) > 1


def test_message_names_the_path(model_dirs, tmp_path):
    """Messages say where: the offending directory is part of the text."""
    directory = copy_checkpoint(model_dirs["llama"], tmp_path / "where-is-it")
    _no_config(directory)
    with pytest.raises(SpecDecError) as info:
        specdec.load_model(directory, device="cpu")
    assert re.search(r"where-is-it", str(info.value))
