"""Rebuild the GGUF test models in tests/data (committed; this records how they were made).

    python tests/data/make.py LLAMA_CPP_DIR

- draft-f32.gguf: the demo draft checkpoint converted in float32, so that llama.cpp and
  transformers run the very same weights (tests/test_llamacpp.py compares them).
- draft-q8_0.gguf: the demo draft quantized to Q8_0 by the converter: a quantized file loads and
  its trees pass the tree check.
- near-f16.gguf: the demo draft with every weight perturbed (seeded noise of 0.3 of each tensor's
  standard deviation), in f16: a fast drafter for the float32 draft that agrees with it only
  sometimes, so the distribution tests see acceptances and rejections.
- wide-q6_k.gguf: a random 2-layer Llama 256 wide (K-quants need rows of 256) on the demo tokenizer,
  Q8_0 with its tied embedding and output matrix in Q6_K (llama.cpp's quantizer), as Q4_K_M files
  of wider models store theirs: specdec's output layer takes it (tests/test_cpu_head.py).
LLAMA_CPP_DIR: a llama.cpp source tree (scripts/convert_to_gguf.py explains where one comes from).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = Path(__file__).parent
DEMO_DRAFT = HERE.parent.parent / "specdec" / "demo_pair" / "draft"
CONVERT = HERE.parent.parent / "scripts" / "convert_to_gguf.py"
NOISE = 0.3


def convert(model: Path, out: Path, outtype: str, llama_cpp: str) -> None:
    subprocess.run([sys.executable, str(CONVERT), str(model), str(out), "--llama-cpp", llama_cpp, "--outtype", outtype,
                    "--pre", "gpt-2"], check=True)


def wide_q6_k(directory: Path, llama_cpp: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    import llama_cpp as bindings

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, head_dim=64, tie_word_embeddings=True, initializer_range=0.1, eos_token_id=0,
                         pad_token_id=0, max_position_embeddings=1024)
    LlamaForCausalLM(config).save_pretrained(directory)
    AutoTokenizer.from_pretrained(DEMO_DRAFT).save_pretrained(directory)
    convert(directory, directory / "wide-f32.gguf", "f32", llama_cpp)
    params = bindings.llama_model_quantize_default_params()
    params.ftype, params.nthread = 7, 1  # LLAMA_FTYPE_MOSTLY_Q8_0
    params.token_embedding_type = params.output_tensor_type = 14  # GGML_TYPE_Q6_K
    if bindings.llama_model_quantize(str(directory / "wide-f32.gguf").encode(), str(HERE / "wide-q6_k.gguf").encode(), params):
        raise SystemExit("llama.cpp could not quantize the wide model")


def near_copy(directory: Path) -> Path:
    model = AutoModelForCausalLM.from_pretrained(DEMO_DRAFT, dtype=torch.float32)
    noise = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(NOISE * weight.std() * torch.randn(weight.shape, generator=noise))
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(DEMO_DRAFT).save_pretrained(directory)
    return directory


if __name__ == "__main__":
    llama_cpp = sys.argv[1]
    convert(DEMO_DRAFT, HERE / "draft-f32.gguf", "f32", llama_cpp)
    convert(DEMO_DRAFT, HERE / "draft-q8_0.gguf", "q8_0", llama_cpp)
    with tempfile.TemporaryDirectory() as tmp:
        convert(near_copy(Path(tmp)), HERE / "near-f16.gguf", "f16", llama_cpp)
    with tempfile.TemporaryDirectory() as tmp:
        wide_q6_k(Path(tmp), llama_cpp)
