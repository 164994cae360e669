"""Convert a Hugging Face checkpoint to GGUF with llama.cpp's own converter, then check its tokenizer.

    python scripts/convert_to_gguf.py --llama-cpp LLAMA_CPP_DIR MODEL_DIR OUT.gguf [--outtype f16] [--pre gpt-2]

LLAMA_CPP_DIR is a llama.cpp source tree with convert_hf_to_gguf.py and gguf-py: the one vendored in
llama-cpp-python's source package, which benchmarks/build_llama_cpp_tools.sh unpacks into
llama.cpp-src/llama_cpp_python-VERSION/vendor/llama.cpp (the converter needs sentencepiece and gguf
installed). The
converter names a BPE pre-tokenizer by hashing how the tokenizer splits a test string and refuses
tokenizers it has not seen; `--pre` names it for such a tokenizer (the demo pair's is a byte-level
BPE with GPT-2's split pattern and no prefix space: `gpt-2`). Afterwards the GGUF's tokenizer
(through llama.cpp) must give the Hugging Face tokenizer's ids on every file of `--check` (default:
a sample of the Python standard library), or the script fails.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path


def convert(llama_cpp: Path, model: Path, out: Path, outtype: str, pre: str | None) -> None:
    sys.path[:0] = [str(llama_cpp), str(llama_cpp / "gguf-py")]
    import convert_hf_to_gguf
    from conversion.base import TextModel

    recognised = TextModel.get_vocab_base_pre

    def named_pre(self, tokenizer) -> str:
        try:
            return recognised(self, tokenizer)
        except NotImplementedError:
            if pre is None:
                raise
            return pre

    TextModel.get_vocab_base_pre = named_pre
    sys.argv = ["convert_hf_to_gguf.py", str(model), "--outfile", str(out), "--outtype", outtype]
    convert_hf_to_gguf.main()


def check_tokenizer(model: Path, out: Path, files: list[Path]) -> None:
    from transformers import AutoTokenizer

    from specdec.runtime.llamacpp import LlamaCppModel

    hf = AutoTokenizer.from_pretrained(model, local_files_only=True)
    gguf = LlamaCppModel(out, context=64).tokenizer
    tokens = 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        want, got = hf.encode(text, add_special_tokens=True), gguf.encode(text, add_special_tokens=True)
        if want != got:
            first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            raise SystemExit(f"{out}: token ids differ from {model}'s tokenizer on {path} at token {first}")
        if gguf.decode(got) != hf.decode(want, skip_special_tokens=True):
            raise SystemExit(f"{out}: decoded text differs from {model}'s tokenizer on {path}")
        tokens += len(want)
    print(f"{out}: the GGUF tokenizer gives the Hugging Face ids on {len(files)} files ({tokens} tokens)")


def stdlib_sample(count: int = 40) -> list[Path]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    return files[:: max(1, len(files) // count)][:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree")
    parser.add_argument("--outtype", default="f16", help="f32, f16, bf16, q8_0 ... (default f16)")
    parser.add_argument("--pre", help="BPE pre-tokenizer name for a tokenizer the converter does not recognise")
    parser.add_argument("--check", type=Path, nargs="*", help="text files to compare token ids on (default: 40 standard-library files)")
    args = parser.parse_args()
    convert(args.llama_cpp, args.model, args.out, args.outtype, args.pre)
    check_tokenizer(args.model, args.out, args.check or stdlib_sample())


if __name__ == "__main__":
    main()
