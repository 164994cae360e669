"""Tiny configs of many decoder-only architectures that transformers ships (the architecture matrix).

Each entry builds a config with the given vocabulary, depth and context; the quirks that matter
for speculation are switched on where the family has them: sliding windows (Mistral, Gemma2/3,
Starcoder2, GPT-Neo local layers), mixtures of experts (Mixtral, Qwen2-MoE), logit soft-capping
(Gemma2), ALiBi (Bloom, Falcon with alibi=True, MPT), learned positions (GPT-2, OPT, GPT-Neo),
partial rotary (Phi, StableLM, GPT-J, Persimmon), and Phi-3's "longrope", whose frequencies
switch when the context passes `original_max_position_embeddings` (half the context here).
"""

from __future__ import annotations

import transformers as tf

HIDDEN, HEADS, KV_HEADS = 32, 4, 2
HEAD_DIM = HIDDEN // HEADS


def _rope_decoder(cls, vocab_size, layers, context, **extra):
    """The common keyword set of Llama-like configs."""
    return cls(vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=layers,
               num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=context, **extra)


def _longrope(context):
    half = HEAD_DIM // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": context // 2,
            "short_factor": [1.0 + 0.1 * i for i in range(half)], "long_factor": [1.0 + 0.7 * i for i in range(half)]}


ARCHITECTURES = {
    "llama": lambda v, n, c: _rope_decoder(tf.LlamaConfig, v, n, c),
    "mistral": lambda v, n, c: _rope_decoder(tf.MistralConfig, v, n, c, sliding_window=8),
    "mixtral": lambda v, n, c: _rope_decoder(tf.MixtralConfig, v, n, c, num_local_experts=4, num_experts_per_tok=2,
                                             sliding_window=None),
    "qwen2": lambda v, n, c: _rope_decoder(tf.Qwen2Config, v, n, c),
    "qwen2_moe": lambda v, n, c: _rope_decoder(tf.Qwen2MoeConfig, v, n, c, num_experts=4, num_experts_per_tok=2,
                                               moe_intermediate_size=HIDDEN, shared_expert_intermediate_size=HIDDEN),
    "qwen3": lambda v, n, c: _rope_decoder(tf.Qwen3Config, v, n, c, head_dim=HEAD_DIM),
    "gemma": lambda v, n, c: _rope_decoder(tf.GemmaConfig, v, n, c, head_dim=HEAD_DIM),
    "gemma2": lambda v, n, c: _rope_decoder(tf.Gemma2Config, v, n, c, head_dim=HEAD_DIM, sliding_window=8,
                                            query_pre_attn_scalar=HEAD_DIM),
    "gemma3": lambda v, n, c: _rope_decoder(tf.Gemma3TextConfig, v, n, c, head_dim=HEAD_DIM, sliding_window=8,
                                            query_pre_attn_scalar=HEAD_DIM, layer_types=["sliding_attention", "full_attention"] * (n // 2) + ["sliding_attention"] * (n % 2)),
    "phi": lambda v, n, c: tf.PhiConfig(vocab_size=v, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=n,
                                        num_attention_heads=HEADS, max_position_embeddings=c, partial_rotary_factor=0.5),
    "phi3-longrope": lambda v, n, c: _rope_decoder(tf.Phi3Config, v, n, c, rope_parameters=_longrope(c),
                                                   original_max_position_embeddings=c // 2, pad_token_id=None),
    "opt": lambda v, n, c: tf.OPTConfig(vocab_size=v, hidden_size=HIDDEN, ffn_dim=2 * HIDDEN, num_hidden_layers=n,
                                        num_attention_heads=HEADS, max_position_embeddings=c, word_embed_proj_dim=HIDDEN),
    "falcon": lambda v, n, c: tf.FalconConfig(vocab_size=v, hidden_size=HIDDEN, num_hidden_layers=n, num_attention_heads=HEADS,
                                              max_position_embeddings=c, alibi=False),
    "falcon-alibi": lambda v, n, c: tf.FalconConfig(vocab_size=v, hidden_size=HIDDEN, num_hidden_layers=n, num_attention_heads=HEADS,
                                                    max_position_embeddings=c, alibi=True),
    "gpt2": lambda v, n, c: tf.GPT2Config(vocab_size=v, n_embd=HIDDEN, n_layer=n, n_head=HEADS, n_positions=c),
    "gptj": lambda v, n, c: tf.GPTJConfig(vocab_size=v, n_embd=HIDDEN, n_layer=n, n_head=HEADS, n_positions=c, rotary_dim=4),
    "gpt_neo": lambda v, n, c: tf.GPTNeoConfig(vocab_size=v, hidden_size=HIDDEN, num_layers=n, num_heads=HEADS,
                                               max_position_embeddings=c, window_size=8,
                                               attention_types=[[["global", "local"], max(1, n // 2)]] if n > 1 else [[["local"], 1]]),
    "gpt_neox": lambda v, n, c: tf.GPTNeoXConfig(vocab_size=v, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=n,
                                                 num_attention_heads=HEADS, max_position_embeddings=c),
    "stablelm": lambda v, n, c: _rope_decoder(tf.StableLmConfig, v, n, c),
    "olmo2": lambda v, n, c: _rope_decoder(tf.Olmo2Config, v, n, c),
    "granite": lambda v, n, c: _rope_decoder(tf.GraniteConfig, v, n, c, embedding_multiplier=2.0, logits_scaling=0.5,
                                             residual_multiplier=0.5, attention_multiplier=0.2),
    "starcoder2": lambda v, n, c: _rope_decoder(tf.Starcoder2Config, v, n, c, sliding_window=8),
    "bloom": lambda v, n, c: tf.BloomConfig(vocab_size=v, hidden_size=HIDDEN, n_layer=n, n_head=HEADS),
    "mpt": lambda v, n, c: tf.MptConfig(vocab_size=v, d_model=HIDDEN, n_layers=n, n_heads=HEADS, max_seq_len=c, expansion_ratio=2),
    "gpt_bigcode": lambda v, n, c: tf.GPTBigCodeConfig(vocab_size=v, n_embd=HIDDEN, n_layer=n, n_head=HEADS, n_positions=c),
    "cohere": lambda v, n, c: _rope_decoder(tf.CohereConfig, v, n, c),
}
