"""Llama checkpoints written as GGUF files for llama.cpp, with gguf-py (the library llama.cpp's own
converter writes with).

`convert_checkpoint` writes what llama.cpp's converter (`convert_hf_to_gguf.py` of the llama.cpp that
llama-cpp-python 0.3.36 vendors, run with `--pre gpt-2`) writes for a transformers Llama checkpoint
with a byte-level BPE tokenizer, byte for byte: the same key/value pairs in the same order, the
tensors in the checkpoint's order (sorted by name within each safetensors file), the same types
(`outtype` f32, f16 or q8_0; norms and 1-D tensors in F32; a matrix Q8_0 cannot hold, in F16) and the
same values (q and k rows permuted from Hugging Face's rotate-half RoPE layout to llama.cpp's
interleaved one). tests/test_demo_pair.py holds the sha256 of the demo pair's files as llama.cpp's
converter wrote them. What it does not convert (rope scaling, mixtures of experts, sentencepiece
vocabularies) it refuses: llama.cpp's converter does those (scripts/convert_to_gguf.py).

`llama_tensor` and `tensor_data` are the per-tensor steps, shared with `specdec.export` (distilled drafts).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from specdec.errors import SpecDecError

# outtype -> (general.file_type, the type of a weight matrix)
OUTTYPES = {"f32": ("ALL_F32", "F32"), "f16": ("MOSTLY_F16", "F16"), "q8_0": ("MOSTLY_Q8_0", "Q8_0")}
SKIPPED = (".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")  # buffers, not weights
GPT2_PRE = "gpt-2"  # llama.cpp's name for GPT-2's byte-level split pattern without a prefix space


def rope_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Rows of a q or k projection (or bias) from rotate-half pairs (i, i + d/2) to adjacent pairs (2i, 2i + 1)."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def llama_tensor(name: str, weight: np.ndarray, heads: int, kv_heads: int, names) -> tuple[str, np.ndarray]:
    """A Hugging Face Llama tensor as llama.cpp stores it: its GGUF name (`names`: gguf's tensor name
    map for the model's block count) and, for q and k, its rows in llama.cpp's RoPE layout."""
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        weight = rope_permute(weight, heads)
    elif name.endswith(("k_proj.weight", "k_proj.bias")):
        weight = rope_permute(weight, kv_heads)
    gguf_name = names.get_name(key=name, try_suffixes=(".weight", ".bias"))
    if gguf_name is None:
        raise SpecDecError(f"no llama.cpp name for the tensor {name!r}")
    return gguf_name, weight


def tensor_data(gguf_name: str, weight: np.ndarray, outtype: str):
    """(data, GGML type) of a tensor in a file of `outtype`: F32 for norms, biases and 1-D tensors
    (what llama.cpp's kernels take), the outtype's type for weight matrices, F16 for a matrix whose
    rows that type cannot split into blocks."""
    import gguf

    qtype = gguf.GGMLQuantizationType
    wanted = qtype[OUTTYPES[outtype][1]]
    if weight.ndim <= 1 or gguf_name.endswith("_norm.weight") or not gguf_name.endswith(".weight"):
        wanted = qtype.F32
    try:
        return gguf.quants.quantize(weight, wanted), wanted
    except gguf.QuantError:
        return gguf.quants.quantize(weight, qtype.F16), qtype.F16


def convert_checkpoint(checkpoint: str | Path, out: str | Path, outtype: str = "f16") -> None:
    """Write the Llama checkpoint directory `checkpoint` (config.json, model*.safetensors, a byte-level
    BPE tokenizer.json) as the GGUF file `out`, as llama.cpp's converter does."""
    import gguf

    checkpoint = Path(checkpoint)
    if outtype not in OUTTYPES:
        raise SpecDecError(f"outtype {outtype!r}: choose one of {', '.join(OUTTYPES)}")
    config = _llama_config(checkpoint)
    _check_byte_level_bpe(checkpoint)
    writer = gguf.GGUFWriter(path=None, arch="llama")
    for name, weight in _llama_tensors(checkpoint, config):
        data, qtype = tensor_data(name, weight, outtype)
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.add_type(gguf.GGUFType.MODEL)
    _add_name_and_size(writer, checkpoint)
    _add_hyperparameters(writer, config, gguf.LlamaFileType[OUTTYPES[outtype][0]])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_vocabulary(writer, checkpoint, config)
    writer.write_header_to_file(path=Path(out))
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _llama_config(checkpoint: Path) -> dict:
    try:
        config = json.loads((checkpoint / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise SpecDecError(f"{checkpoint}: no readable config.json ({error})") from error
    if config.get("architectures") != ["LlamaForCausalLM"]:
        raise SpecDecError(f"{checkpoint}: a LlamaForCausalLM checkpoint is converted here, "
                           f"not {config.get('architectures')}")
    rope = _rope_parameters(config)
    if rope.get("rope_type", rope.get("type", "default")) != "default" or config.get("num_local_experts"):
        raise SpecDecError(f"{checkpoint}: rope scaling and experts need llama.cpp's own converter "
                           "(scripts/convert_to_gguf.py)")
    return config


def _rope_parameters(config: dict) -> dict:
    return config.get("rope_parameters", config.get("rope_scaling")) or {}


def _check_byte_level_bpe(checkpoint: Path) -> None:
    """The converter's GPT-2 vocabulary path: a BPE tokenizer.json over bytes (no byte fallback, no
    sentencepiece model) whose pre-tokenizer is GPT-2's split pattern with no prefix space."""
    try:
        tokenizer = json.loads((checkpoint / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise SpecDecError(f"{checkpoint}: no readable tokenizer.json ({error})") from error
    model, pre = tokenizer.get("model") or {}, tokenizer.get("pre_tokenizer") or {}
    gpt2_split = pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space", True)
    if ((checkpoint / "tokenizer.model").exists() or model.get("type") != "BPE" or model.get("byte_fallback")
            or not gpt2_split):
        raise SpecDecError(f"{checkpoint}: not a byte-level BPE tokenizer with GPT-2's split; "
                           "convert it with llama.cpp's converter (scripts/convert_to_gguf.py)")


def _llama_tensors(checkpoint: Path, config: dict):
    """(GGUF name, array) of every weight, file by file, each file's tensors sorted by name (the
    converter's order). Float16 and float32 keep their type; other types become float32."""
    import gguf
    import torch
    from safetensors import safe_open

    parts = sorted(checkpoint.glob("model*.safetensors"))
    if not parts:
        raise SpecDecError(f"{checkpoint}: no model*.safetensors")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    for part in parts:
        with safe_open(str(part), framework="pt") as tensors:
            for name in sorted(tensors.keys()):
                if name.endswith(SKIPPED):
                    continue
                weight = tensors.get_tensor(name)
                if weight.dtype not in (torch.float16, torch.float32):
                    weight = weight.to(torch.float32)
                yield llama_tensor(name, weight.numpy(), heads, kv_heads, names)


def _add_name_and_size(writer, checkpoint: Path) -> None:
    """general.name from the directory's name (gguf-py's heuristics: "target" -> "Target") and the
    size label from the parameters written ("23M")."""
    import gguf

    total, shared, experts, expert_count = writer.get_total_parameter_count()
    metadata = gguf.Metadata.load(None, checkpoint, None, total)
    metadata.name = metadata.name or checkpoint.name
    metadata.size_label = metadata.size_label or gguf.size_label(total, shared, experts, expert_count)
    metadata.set_gguf_meta_model(writer)


def _add_hyperparameters(writer, config: dict, file_type) -> None:
    """The converter's keys for a Llama, in its order."""
    heads = config["num_attention_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads", heads))
    if config.get("is_causal") is False:
        writer.add_causal_attention(False)
    rope_theta = _rope_parameters(config).get("rope_theta", config.get("rope_theta"))
    if rope_theta is not None:
        writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("head_dim") is not None:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    writer.add_file_type(file_type)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // heads)


def _add_vocabulary(writer, checkpoint: Path, config: dict) -> None:
    """The converter's GPT-2 vocabulary: every id's token (ids the tokenizer lacks as [PADi], unused),
    its type (special added tokens and names like <|...|> are control tokens), the merges and
    the special token ids (gguf-py's SpecialVocab reads them as the converter does)."""
    import gguf

    tokenizer_config = checkpoint / "tokenizer_config.json"
    if (tokenizer_config.is_file()
            and (prefix := json.loads(tokenizer_config.read_text()).get("add_prefix_space")) is not None):
        writer.add_add_space_prefix(prefix)
    tokens, types = _tokens_and_types(checkpoint, config)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(GPT2_PRE)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(checkpoint, load_merges=True).add_to_gguf(writer, quiet=True)


def _tokens_and_types(checkpoint: Path, config: dict) -> tuple[list[str], list[int]]:
    import gguf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    by_id = {i: token for token, i in tokenizer.get_vocab().items()}
    vocab_size = config.get("vocab_size", len(by_id))
    if max(by_id) >= vocab_size:
        raise SpecDecError(f"{checkpoint}: the tokenizer has ids up to {max(by_id)}, the model {vocab_size} rows")
    added, decoders = tokenizer.get_added_vocab(), tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        if token in added:
            if not decoders[i].normalized:  # llama.cpp takes added tokens as normalised text
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            if decoders[i].special or _looks_special(token):
                types.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    return tokens, types


def _looks_special(token: str) -> bool:
    """The converter's rule for added tokens that ought to be control tokens though not marked special."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>"))
            or (token.startswith("<unused") and token.endswith(">")))
