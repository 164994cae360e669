"""Tiny random Hugging Face checkpoints, saved with save_pretrained and loaded by the real loader."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from architectures import ARCHITECTURES

CHARS = "abcdefghijklm n"  # 15 characters + <eos> = a 16-token vocabulary
EOS_TEXT = "<|endoftext|>"  # the name several tokenizer classes insist on
VOCAB = {EOS_TEXT: 0, **{c: i + 1 for i, c in enumerate(CHARS)}}
EOS = 0
ALIASES = {"neox": "gpt_neox"}


def make_tokenizer(with_eos: bool = True) -> PreTrainedTokenizerFast:
    """Character-level: BPE over single characters with no merges.

    with_eos=False: id 0 is an ordinary token, so generations run to their length limit.
    """
    backend = Tokenizer(models.BPE(vocab=dict(VOCAB), merges=[], unk_token=None))
    backend.decoder = decoders.Fuse()
    if not with_eos:
        return PreTrainedTokenizerFast(tokenizer_object=backend)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TEXT, pad_token=EOS_TEXT)


def make_config(arch: str, vocab_size: int, layers: int = 2, context: int = 64, with_eos: bool = True):
    """A tiny config of any architecture in `architectures.ARCHITECTURES` ("neox" = gpt_neox)."""
    config = ARCHITECTURES[ALIASES.get(arch, arch)](vocab_size, layers, context)
    eos = EOS if with_eos else None
    config.bos_token_id, config.eos_token_id, config.pad_token_id = None, eos, eos
    return config


def save_tiny_model(directory: Path, arch: str, seed: int, vocab_rows: int = len(VOCAB),
                    logit_scale: float = 8.0, layers: int = 2, with_eos: bool = False, noise: float = 0.0,
                    context: int = 64, attn_implementation: str | None = None) -> Path:
    """Random weights; logit_scale sharpens (>1) or flattens the output distributions.

    vocab_rows > len(VOCAB) pads the embeddings, as real checkpoints of one family do.
    noise > 0 perturbs every weight: with the target's seed and size, a draft that agrees often but not always.
    """
    torch.manual_seed(seed)
    config = make_config(arch, vocab_rows, layers=layers, context=context, with_eos=with_eos)
    if attn_implementation:  # recorded in config.json: the implementation the loader will pick
        config._attn_implementation = attn_implementation
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(logit_scale)
        perturb = torch.Generator().manual_seed(seed + 10_000)
        for weight in model.parameters():
            weight.add_(noise * torch.randn(weight.shape, generator=perturb))
    model.generation_config.eos_token_id = EOS if with_eos else None
    model.save_pretrained(directory)
    make_tokenizer(with_eos).save_pretrained(directory)
    return directory


if __name__ == "__main__":  # python tests/tiny.py DIR [ARCH]: a random target/draft pair to try the CLI on
    import sys

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "tiny-pair")
    arch = sys.argv[2] if len(sys.argv) > 2 else "llama"
    if ALIASES.get(arch, arch) not in ARCHITECTURES:
        sys.exit(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    save_tiny_model(out / "target", arch, seed=0, layers=4, with_eos=False)
    save_tiny_model(out / "draft", arch, seed=1, layers=1, with_eos=False)
    print(f"wrote {out / 'target'} and {out / 'draft'} ({arch})")
