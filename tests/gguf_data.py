"""The GGUF test models, made from the demo draft checkpoint the first time a test session needs
them (the `gguf_models` fixture), into specdec's cache (`specdec.cache`): a folder keyed by the
draft checkpoint, this file and specdec's GGUF writer, so a change to any of them makes them anew.

- draft-f32.gguf: the demo draft in float32, so that llama.cpp and transformers run the very same
  weights (tests/test_llamacpp.py compares them).
- draft-q8_0.gguf: the demo draft in Q8_0: a quantized file loads and its trees pass the tree check.
- near-f16.gguf: the demo draft with every weight perturbed (seeded noise of 0.3 of each tensor's
  standard deviation), in f16: a fast drafter for the float32 draft that agrees with it only
  sometimes, so the distribution tests see acceptances and rejections.
- wide-q6_k.gguf: a random 2-layer Llama 256 wide (K-quants need rows of 256) on the demo tokenizer,
  Q8_0 with its tied embedding and output matrix in Q6_K (llama.cpp's quantizer), as Q4_K_M files
  of wider models store theirs: specdec's output layer takes it (tests/test_cpu_head.py).

The first three are written by `specdec.gguf_files` exactly as llama.cpp's converter writes them
(draft-f32 and draft-q8_0 are byte for byte the files the converter made); wide-q6_k is the
writer's f32 file quantized by llama.cpp. All four take a few seconds.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from specdec import gguf_files
from specdec.demo import DEMO_DIR
from specdec.cache import cache_dir, made_once, source_digest
from specdec.gguf_files import convert_checkpoint

DEMO_DRAFT = DEMO_DIR / "draft"
NOISE = 0.3
LLAMA_FTYPE_MOSTLY_Q8_0, GGML_TYPE_Q6_K = 7, 14  # llama.h's and ggml.h's numbers


def made_test_models() -> dict[str, str]:
    """name -> path of every test model, made where missing."""
    folder = cache_dir() / "test-models" / source_digest(DEMO_DRAFT, Path(__file__), Path(gguf_files.__file__))
    makers = {
        "draft-f32": lambda out: convert_checkpoint(DEMO_DRAFT, out, "f32"),
        "draft-q8_0": lambda out: convert_checkpoint(DEMO_DRAFT, out, "q8_0"),
        "near-f16": near_f16,
        "wide-q6_k": wide_q6_k,
    }
    return {name: str(made_once(folder / f"{name}.gguf", make, f"the test model {name}.gguf")) for name, make in makers.items()}


def near_f16(out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        convert_checkpoint(perturbed_draft(Path(tmp) / "near-f16"), out, "f16")


def wide_q6_k(out: Path) -> None:
    import llama_cpp as bindings

    with tempfile.TemporaryDirectory() as tmp:
        f32 = Path(tmp) / "wide-f32.gguf"
        convert_checkpoint(random_wide_llama(Path(tmp) / "wide"), f32, "f32")
        params = bindings.llama_model_quantize_default_params()
        params.ftype, params.nthread = LLAMA_FTYPE_MOSTLY_Q8_0, 1
        params.token_embedding_type = params.output_tensor_type = GGML_TYPE_Q6_K
        if bindings.llama_model_quantize(str(f32).encode(), str(out).encode(), params):
            raise RuntimeError("llama.cpp could not quantize the wide model")


def perturbed_draft(directory: Path) -> Path:
    """The demo draft in float32 with seeded noise added to every weight, saved as a checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(DEMO_DRAFT, dtype=torch.float32)
    noise = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(NOISE * weight.std() * torch.randn(weight.shape, generator=noise))
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(DEMO_DRAFT).save_pretrained(directory)
    return directory


def random_wide_llama(directory: Path) -> Path:
    """A random Llama 256 wide on the demo tokenizer (seed 0; the session's random state is left as it was)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, head_dim=64, tie_word_embeddings=True, initializer_range=0.1, eos_token_id=0,
                         pad_token_id=0, max_position_embeddings=1024)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(directory)
    AutoTokenizer.from_pretrained(DEMO_DRAFT).save_pretrained(directory)
    return directory
