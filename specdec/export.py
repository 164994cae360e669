"""A distilled draft's files: its tokenizer (the target's pieces it predicts) and a GGUF for llama.cpp.

`write_gguf` writes a transformers Llama model as llama.cpp's "llama" architecture with gguf-py,
the library llama.cpp's own converter writes with, tensor by tensor as `specdec.gguf_files`
converts a checkpoint (llama.cpp's names, q and k rows in its RoPE layout, matrices as Q8_0, F16
where a row is not a multiple of 32, norms as F32), the tied output layer left to token_embd. The
draft's `VocabMap` goes into the metadata (`runtime.pruned.GGUF_KEYS`), so the file alone is
enough beside its target.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.gguf_files import SKIPPED, llama_tensor, tensor_data
from specdec.runtime.pruned import GGUF_KEYS, VocabMap


def save_draft(model, vocab_map: VocabMap, pieces: list[str], directory: str | Path, gguf: bool = True) -> None:
    """A pruned draft's files in `directory`: the transformers checkpoint (float32), vocab_map.json,
    the tokenizer over its pieces and, with `gguf`, draft.gguf for llama.cpp."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.to(torch.float32).cpu().save_pretrained(directory)
    vocab_map.save(directory)
    draft_tokenizer(pieces, model.config.eos_token_id).save_pretrained(directory)
    if gguf:
        write_gguf(model, pieces, vocab_map, directory / "draft.gguf")


def draft_tokenizer(pieces: list[str], eos_id: int | None):
    """A word-level tokenizer over the draft's pieces: it names the draft's ids (the engine feeds
    target ids through the vocabulary map, never text)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({piece: i for i, piece in enumerate(pieces)}, unk_token=pieces[-1]))
    eos = {"eos_token": pieces[eos_id]} if eos_id is not None else {}
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=pieces[-1], model_max_length=10**9, **eos)


def write_gguf(model, pieces: list[str], vocab_map: VocabMap, path: str | Path) -> None:
    import gguf

    config = model.config
    state = {name: tensor.detach().float().cpu().numpy() for name, tensor in model.state_dict().items()}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("specdec distilled draft")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(len(pieces))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores([0.0] * len(pieces))
    writer.add_token_types([gguf.TokenType.NORMAL] * (len(pieces) - 1) + [gguf.TokenType.UNKNOWN])
    writer.add_unk_token_id(len(pieces) - 1)
    if config.eos_token_id is not None:
        writer.add_eos_token_id(config.eos_token_id)
    writer.add_add_bos_token(False)
    ids, fingerprint, size = GGUF_KEYS
    writer.add_array(ids, list(vocab_map.target_ids))
    writer.add_string(fingerprint, vocab_map.target_fingerprint)
    writer.add_uint32(size, vocab_map.target_vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for hf_name, weight in state.items():
        if hf_name.endswith(SKIPPED) or (hf_name == "lm_head.weight" and config.tie_word_embeddings):
            continue  # buffers; a tied output layer llama.cpp takes from token_embd
        name, weight = llama_tensor(hf_name, weight, config.num_attention_heads, config.num_key_value_heads, names)
        data, qtype = tensor_data(name, weight, "q8_0")
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

