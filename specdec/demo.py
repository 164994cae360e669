"""The demo pair that ships with specdec: two small checkpoints, their GGUF files and an n-gram
model, the files made in specdec's cache the first time they are needed (no download)."""

from __future__ import annotations

from pathlib import Path

from specdec.errors import SpecDecError
from specdec.runtime import runs_gguf, tokenizer_fingerprint


DEMO_DIR = Path(__file__).parent / "demo_pair"  # target/, draft/ (checkpoints), MODELS.md
DEMO_NGRAM_SKIPPED = {"test", "tests", "idlelib", "lib2to3"}  # standard library folders the demo n-gram leaves out


def demo_dir() -> Path:
    if not (DEMO_DIR / "target" / "config.json").is_file():
        raise SpecDecError("no target model given and the demo pair is not installed; pass --target DIR")
    return DEMO_DIR


def demo_models(backend: str = "auto") -> tuple[str, str]:
    """(target, draft) of the demo pair: GGUF files where the backend runs them (llama.cpp), else checkpoints."""
    demo = demo_dir()
    if not runs_gguf(backend):
        return str(demo / "target"), str(demo / "draft")
    return str(demo_gguf("target")), str(demo_gguf("draft"))


def demo_gguf(name: str) -> Path:
    """The demo pair's `name` ("target" or "draft") as an f16 GGUF file for llama.cpp, the very file
    llama.cpp's converter made of its checkpoint (specdec.gguf_files), written into specdec's cache
    the first time it is needed. It is named NAME.gguf, the name a server reports for the model."""
    from specdec import gguf_files
    from specdec.cache import cache_dir, made_once, source_digest

    if name not in ("target", "draft"):
        raise ValueError(f"the demo pair has a target and a draft, not {name!r}")
    checkpoint = demo_dir() / name
    # a new writer writes anew
    folder = cache_dir() / "demo_pair" / source_digest(checkpoint, Path(gguf_files.__file__))
    return made_once(folder / f"{name}.gguf", lambda out: gguf_files.convert_checkpoint(checkpoint, out, "f16"),
                     f"the demo pair's {name}.gguf")


def demo_ngram() -> Path:
    """The demo pair's Katz trigram (`specdec ngram build` over `demo_ngram_sources()` with the
    target's tokenizer), built into specdec's cache the first time it is needed; it depends on this
    interpreter's standard library, so its folder is keyed by the Python version too."""
    import sys
    import sysconfig

    from specdec import katz
    from specdec.cache import cache_dir, made_once, source_digest

    tokenizer = demo_dir() / "target"
    stdlib = f"{sys.implementation.name} {sys.version} {sysconfig.get_paths()['stdlib']}"
    sources = (tokenizer / "tokenizer.json", tokenizer / "tokenizer_config.json", Path(katz.__file__))
    folder = cache_dir() / "demo_pair" / source_digest(*sources, salt=stdlib)
    return made_once(folder / "ngram.safetensors", lambda out: _build_demo_ngram(tokenizer, out),
                     "the demo pair's n-gram model")


def demo_ngram_sources() -> list[Path]:
    """The files scripts/make_demo_pair.sh built the demo n-gram from: the standard library's .py
    files outside site-packages, sorted; less every 50th (held out from training, as `specdec train`
    splits them); less those under test, tests, idlelib and lib2to3; then every fifth from the first."""
    import sysconfig

    from specdec.train import split_files, stdlib_sources

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    trained, _ = split_files(stdlib_sources(), 0.02)
    kept = [f for f in trained if not DEMO_NGRAM_SKIPPED.intersection(f.relative_to(stdlib).parts[:-1])]
    if not kept:
        raise SpecDecError(f"this Python's standard library sources are not installed ({stdlib}); "
                           "pass an n-gram file (--ngram)")
    return kept[::5]


def _build_demo_ngram(tokenizer_dir: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    from specdec.katz import build_from_files

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    build_from_files(demo_ngram_sources(), tokenizer, fingerprint=tokenizer_fingerprint(tokenizer)).save(out)
