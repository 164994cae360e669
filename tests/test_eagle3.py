"""EAGLE-3 heads (`specdec.runtime.eagle3`): published layouts loaded as they are, the target's states
at three layers read from the forward that runs, and every lossless test a draft model meets.

Each head here is made with random weights (seeded) in one of the two published layouts — EAGLE-3 /
SpecForge (`midlayer.`, the target's embeddings) and Red Hat's speculators (`layers.0.`, its own
embeddings, `norm_before_residual`) — over a few of the target's tokens (the target's greedy
output and a few more, so that it is accepted now and then), written as config.json and
safetensors, and loaded through `load_draft` as `--draft DIR` loads it. The head's own math is
checked against a reference computed here from the target's `output_hidden_states` with
transformers' rotary embedding and torch's attention; its cache against each path fed alone.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import specdec
from specdec import AutoDrafter, ModelDrafter, PromptLookupDrafter, SpeculativeDecoder, TreeShape
from specdec.runtime import load_draft
from specdec.runtime.eagle3 import Eagle3Model
from architectures import ARCHITECTURES
from conftest import reference_greedy
from test_architectures import TREES_REFUSED, load_or_skip
from test_statistical import assert_follows_target
from tiny import save_tiny_model

LAYERS = [1, 2, 3]  # of a 4-layer tiny target
PROMPTS = ([1, 2, 3], [5, 9, 5, 9, 5], [14, 0, 3, 3, 7, 1])
T07_TOP5 = dict(temperature=0.7, top_k=5)


def write_eagle3(directory: Path, target: specdec.CausalLM, keep: list[int], layout: str = "eagle3",
                 layers: list[int] | None = LAYERS, seed: int = 0, heads: int = 4, kv_heads: int = 2,
                 head_dim: int | None = None, **overrides) -> Path:
    """A random EAGLE-3 head for `target` predicting the target ids `keep`, in a published layout:
    "eagle3" (SpecForge: midlayer., no embeddings of its own) or "speculators" (layers.0., its own
    embeddings, norm_before_residual). `overrides` change the config (to make heads that do not fit)."""
    hidden, vocab = target.hidden_size, target.vocab_size
    head_dim = head_dim or hidden // heads
    generator = torch.Generator().manual_seed(seed)

    def matrix(rows: int, columns: int) -> torch.Tensor:
        return torch.randn(rows, columns, generator=generator) / columns ** 0.5

    prefix = "midlayer." if layout == "eagle3" else "layers.0."
    keep = sorted(keep)
    tensors = {"fc.weight": matrix(hidden, 3 * hidden), "norm.weight": torch.ones(hidden),
               "lm_head.weight": 4 * matrix(len(keep), hidden),
               "d2t": torch.tensor(keep) - torch.arange(len(keep)),
               "t2d": torch.isin(torch.arange(vocab), torch.tensor(keep)),
               f"{prefix}input_layernorm.weight": torch.ones(hidden), f"{prefix}hidden_norm.weight": torch.ones(hidden),
               f"{prefix}post_attention_layernorm.weight": torch.ones(hidden),
               f"{prefix}self_attn.q_proj.weight": matrix(heads * head_dim, 2 * hidden),
               f"{prefix}self_attn.k_proj.weight": matrix(kv_heads * head_dim, 2 * hidden),
               f"{prefix}self_attn.v_proj.weight": matrix(kv_heads * head_dim, 2 * hidden),
               f"{prefix}self_attn.o_proj.weight": matrix(hidden, heads * head_dim),
               f"{prefix}mlp.gate_proj.weight": matrix(2 * hidden, hidden),
               f"{prefix}mlp.up_proj.weight": matrix(2 * hidden, hidden),
               f"{prefix}mlp.down_proj.weight": matrix(hidden, 2 * hidden)}
    layer = {"hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
             "intermediate_size": 2 * hidden, "vocab_size": vocab, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
             "max_position_embeddings": 4096}
    if layout == "eagle3":
        config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
                  "draft_vocab_size": len(keep), **layer}
        if layers is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layers}
    else:
        tensors["embed_tokens.weight"] = matrix(vocab, hidden)
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "draft_vocab_size": len(keep),
                  "norm_before_residual": True, "target_hidden_size": hidden, "transformer_layer_config": layer}
        if layers is not None:
            config["eagle_aux_hidden_state_layer_ids"] = layers
    config.update(overrides)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(directory / "model.safetensors"))
    return directory


def predicted_tokens(target: specdec.CausalLM, prompts, extra: int = 3) -> list[int]:
    """The target's greedy tokens after the prompts and `extra` tokens it never chose: few, so a random
    head agrees with it now and then."""
    plain = SpeculativeDecoder(target)
    greedy = {t for prompt in prompts for t in plain.generate(list(prompt), max_new_tokens=24, temperature=0).tokens}
    return sorted(greedy | set([t for t in range(target.vocab_size) if t not in greedy][:extra]))


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    directory = save_tiny_model(tmp_path_factory.mktemp("eagle3-target") / "llama", "llama", seed=5, layers=4)
    return str(directory), specdec.load_model(directory, device="cpu", dtype="float64")


@pytest.fixture(scope="module", params=["eagle3", "speculators"])
def hf_eagle3(request, tiny_target, tmp_path_factory):
    """The tiny 4-layer llama target (float64) and a random head in each published layout."""
    _, target = tiny_target
    directory = write_eagle3(tmp_path_factory.mktemp(f"eagle3-{request.param}"), target,
                             predicted_tokens(target, PROMPTS), layout=request.param)
    draft = load_draft(directory, target)
    assert isinstance(draft, Eagle3Model) and draft.net.config.layout == request.param
    return target, draft, directory


# ------------------------------------------------------------------------------ the head's math


def reference_logits(draft: Eagle3Model, target, tokens: list[int]) -> torch.Tensor:
    """[len(tokens) - 1, draft vocab]: the head's logits after each prefix of `tokens` (from the second
    token on), computed here as EAGLE-3 defines them: the target's hidden_states at the head's layers,
    fused; the entry of token t reads the feature at t - 1; causal attention over those entries."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    net, config = draft.net, draft.net.config
    with torch.no_grad():
        hidden = target.model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        # [n, 3 * hidden]
        states = torch.cat([hidden[i][0] for i in draft.state_layers], dim=-1).to(net.fc.weight.dtype)
        features, embeds = net.fc(states)[:-1], net.embed_tokens[torch.tensor(tokens[1:])]  # entries 1 .. n - 1
        layer = net.midlayer
        normed = layer.hidden_norm(features)
        residual = normed if config.norm_before_residual else features
        x = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)[None]  # [1, m, 2 * hidden]
        m, d = x.shape[1], config.head_dim
        q = layer.self_attn.q_proj(x).view(1, m, config.heads, d).transpose(1, 2)
        k = layer.self_attn.k_proj(x).view(1, m, config.kv_heads, d).transpose(1, 2)
        v = layer.self_attn.v_proj(x).view(1, m, config.kv_heads, d).transpose(1, 2)
        cos, sin = net.rotary(x, torch.arange(1, m + 1)[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        residual = layer.self_attn.o_proj(attended.transpose(1, 2).reshape(1, m, -1))[0] + residual
        out = layer.mlp(layer.post_attention_layernorm(residual)) + residual
        return net.lm_head(net.norm(out))


def layer_states(draft: Eagle3Model, target, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), 3 * hidden]: the target's states at the head's layers after each token, as its
    forward leaves them."""
    target.keep_states(layers=draft.state_layers)
    try:
        sequence = target.sequence()
        sequence.forward(tokens, last=1)
        states = sequence.states
        sequence.release()
    finally:
        target.keep_states(False)
    assert states.shape == (len(tokens), 3 * target.hidden_size)
    return states


def observed_head(draft: Eagle3Model, target, text: list[int]):
    """An empty head sequence told the target's states at every position of `text` (as the engine
    tells it after a prefill and after verifies)."""
    head = draft.sequence()
    head.observe(0, layer_states(draft, target, text))
    return head


def test_the_heads_rows_are_eagle3s_computed_by_hand(hf_eagle3):
    """Fed a text whose every state the target reported, the head's rows equal the reference; told
    nothing, they do not (the states are read)."""
    target, draft, _ = hf_eagle3
    tokens = [1, 2, 3, 5, 9, 2, 6, 5, 3]
    want = reference_logits(draft, target, tokens)
    got = observed_head(draft, target, tokens).forward(tokens)[1:]
    torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-4)
    blind = draft.sequence().forward(tokens)[1:]
    assert not torch.allclose(blind, want.float(), atol=1e-2)


def test_a_tree_forwards_rows_equal_each_path_alone(hf_eagle3):
    """Draft nodes read their parents' outputs: a tree's rows equal each path fed alone as a chain."""
    target, draft, _ = hf_eagle3
    prefix = [1, 2, 3, 1, 5, 9, 2]
    tokens, parents = [4, 5, 6, 7, 8], [-1, 0, -1, 1, 2]  # below the prefix's last token: two branches, depth 3
    last = len(prefix) - 1
    entries = list(range(-1, last)) + [last if p < 0 else len(prefix) + p for p in parents]
    tree_rows = observed_head(draft, target, prefix).forward(prefix + tokens, entries)
    for node in range(len(tokens)):
        path, at = [], node
        while at >= 0:
            path.insert(0, tokens[at])
            at = parents[at]
        alone = observed_head(draft, target, prefix).forward(prefix + path)[-1]
        torch.testing.assert_close(tree_rows[len(prefix) + node], alone, rtol=1e-5, atol=1e-5)


def test_kept_draft_nodes_are_reread_from_the_targets_states(hf_eagle3):
    """Draft nodes kept as committed text take the target's features once reported: the next rows
    equal those of a sequence fed the same text with every state known."""
    target, draft, _ = hf_eagle3
    prefix, path = [1, 2, 3, 1, 5, 9], [2, 6, 5]
    s = len(prefix) - 1  # the last committed token's entry: the draft grows below it
    head = observed_head(draft, target, prefix[:-1])  # the state at its position is not known yet
    head.forward(prefix[:-1])
    head.forward(prefix[-1:] + path + [7], [s - 1, s, s + 1, s + 2, s + 1])  # a chain of 3 and a sibling
    head.keep(len(prefix), [s + 1, s + 2])  # two of the chain accepted
    head.observe(s, layer_states(draft, target, prefix + path[:2])[s:])  # the verify's root and accepted nodes
    after = head.forward([path[2], 4])
    text = prefix + path[:2]
    fresh = observed_head(draft, target, text).forward(text + [path[2], 4])[-2:]
    torch.testing.assert_close(after, fresh, rtol=1e-5, atol=1e-5)
    stale = draft.sequence()  # the same without re-reading: the kept nodes' guessed inputs stay
    stale.observe(0, layer_states(draft, target, prefix[:-1]))
    stale.forward(prefix[:-1] + prefix[-1:] + path[:2])
    assert not torch.allclose(stale.forward([path[2], 4]), fresh, atol=1e-3)


# ------------------------------------------------------------------------------ lossless


def drafters_of(draft) -> dict:
    return {"chain": (ModelDrafter(draft), 3), "tree": (ModelDrafter(draft, tree=TreeShape(nodes=6, width=2)), 3),
            "staged": (ModelDrafter(draft, tree=TreeShape(nodes=5, width=2), inner=PromptLookupDrafter(),
                                    inner_gamma=2), 3),
            "default": (AutoDrafter(ModelDrafter(draft), PromptLookupDrafter()), "auto")}


def test_greedy_speculation_with_an_eagle3_head_equals_plain_greedy_transformers(hf_eagle3, tiny_target):
    target, draft, directory = hf_eagle3
    accepted = Counter()
    for prompt in PROMPTS:
        reference = reference_greedy(target, list(prompt), 20)
        for name, (drafter, gamma) in drafters_of(draft).items():
            result = SpeculativeDecoder(target, drafter, gamma).generate(list(prompt), max_new_tokens=20, temperature=0)
            assert result.tokens == reference, name
            accepted[name] += result.stats.accepted
    assert accepted["chain"] + accepted["tree"] > 0, accepted
    decoder = specdec.load(tiny_target[0], draft=str(directory), gamma="auto", dtype="float64")  # as the CLI loads one
    assert isinstance(decoder.draft_model, Eagle3Model)
    result = decoder.generate([1, 2, 3], max_new_tokens=20, temperature=0)
    assert result.tokens == reference_greedy(target, [1, 2, 3], 20)


def test_the_server_batches_requests_with_an_eagle3_head_into_plain_greedy_text(hf_eagle3, tiny_target):
    """`specdec serve --draft HEAD`: eight requests at once share the target's forwards; each row's head
    reads its own row's states, and every reply is plain greedy's text."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from specdec.server import create_app
    from test_server import LiveServer

    _, _, directory = hf_eagle3
    plain = specdec.load(tiny_target[0], dtype="float64")
    decoder = specdec.load(tiny_target[0], draft=str(directory), gamma=3, dtype="float64")  # the head drafts every step
    prompts = [f"h{'ij'[i % 2]} e{chr(97 + i)} {chr(100 + i) * 3}" for i in range(8)]
    live = LiveServer(create_app(decoder, "tiny", max_queue=16, depth=None))
    try:
        def complete(prompt):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 20, "temperature": 0}
            return httpx.post(live.url + "/v1/completions", json=body, timeout=120).json()

        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(complete, prompts))
    finally:
        live.stop()
    assert [r["choices"][0]["text"] for r in replies] == [
        plain.generate(p, max_new_tokens=20, temperature=0).text for p in prompts]
    assert sum(r["speculative"]["acceptance_rate"] for r in replies) > 0, replies


@pytest.mark.parametrize("compile", ["graphs", "aot_eager"])
def test_the_static_pool_gives_the_heads_layers_and_its_greedy_output_is_plain(tiny_target, tmp_path, compile):
    """The static pool's compiled forwards (a CUDA graph's buffers; torch.compile's trace) return the
    inputs of the head's layers as a second output: every token's, as the eager forward gives them,
    padded buckets and batched rows aside; every drafter with the head gives plain greedy text on it."""
    target_dir, target = tiny_target
    pool = specdec.load_model(target_dir, device="cpu", dtype="float64", compile=compile)
    directory = write_eagle3(tmp_path / "head", target, predicted_tokens(target, PROMPTS))
    draft = load_draft(directory, pool)
    for tokens in ([1, 2, 3, 5, 9], [4, 4, 1]):
        torch.testing.assert_close(layer_states(draft, pool, tokens), layer_states(draft, target, tokens),
                                   rtol=1e-9, atol=1e-9)
    accepted = 0
    for prompt in PROMPTS:
        reference = reference_greedy(target, list(prompt), 20)
        for name, (drafter, gamma) in drafters_of(draft).items():
            result = SpeculativeDecoder(pool, drafter, gamma).generate(list(prompt), max_new_tokens=20, temperature=0)
            assert result.tokens == reference, name
            accepted += result.stats.accepted
    assert accepted > 0


@pytest.mark.statistical
def test_sampled_speculation_with_an_eagle3_head_follows_the_target(tiny_target, tmp_path):
    """A chain at T 0.7 top-5 with a speculators-layout head (the layouts differ only in how the head is
    read, which the rows by hand check for both; the tree takes T 1 top-3 on llama.cpp): 45 s on 2 cores."""
    _, target = tiny_target
    draft = load_draft(write_eagle3(tmp_path / "head", target, predicted_tokens(target, PROMPTS), layout="speculators"),
                       target)
    assert_follows_target(SpeculativeDecoder(target, ModelDrafter(draft), gamma=2), T07_TOP5,
                          seed_key="eagle3/speculators/chain")


MATRIX_PROMPT = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]


@pytest.mark.architectures
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_eagle3_drafter_equals_plain_greedy_on_the_architecture_matrix(arch, implementation, tmp_path):
    target_dir = save_tiny_model(tmp_path / arch, arch, seed=list(ARCHITECTURES).index(arch), layers=4)
    target = load_or_skip(str(target_dir), arch, implementation)
    keep = predicted_tokens(target, [MATRIX_PROMPT], extra=1)
    draft = load_draft(write_eagle3(tmp_path / "head", target, keep), target)
    new = min(60, target.max_length - len(MATRIX_PROMPT))
    plain = SpeculativeDecoder(target).generate(MATRIX_PROMPT, max_new_tokens=new, temperature=0).tokens
    assert plain == reference_greedy(target, MATRIX_PROMPT, len(plain))
    accepted = Counter()
    for name, (drafter, gamma) in drafters_of(draft).items():
        if name in ("tree", "staged") and arch in TREES_REFUSED:
            continue
        result = SpeculativeDecoder(target, drafter, gamma).generate(MATRIX_PROMPT, max_new_tokens=new, temperature=0)
        assert result.tokens == plain, f"{name} differs from plain greedy"
        accepted[name] += result.stats.accepted
    assert sum(accepted.values()) > 0, "no draft token accepted: the test would prove little"


# ------------------------------------------------------------------------------ llama.cpp

GGUF_LAYERS = [1, 3, 4]  # of the demo target's 6 (the default, 2, 3 and 3, names a layer twice)
GGUF_PROMPTS = ([1, 2, 3, 4, 5, 6], [300, 301, 302, 300, 301])


@pytest.fixture(scope="module")
def gguf_eagle3(gguf_models, tmp_path_factory):
    """The demo target (f16) on llama.cpp and a random head predicting its greedy tokens after the test
    prompts and the 16 it samples most at T 1, top-3, after the first."""
    target = specdec.load_model(gguf_models["gguf-f16"], threads=1)
    plain = SpeculativeDecoder(target)
    sampled = Counter(t for seed in range(100) for t in plain.generate(
        list(GGUF_PROMPTS[0]), max_new_tokens=3, temperature=1.0, top_k=3, seed=50_000 + seed).tokens)
    keep = sorted(set(predicted_tokens(target, GGUF_PROMPTS, extra=0)) | {int(t) for t, _ in sampled.most_common(16)})
    directory = write_eagle3(tmp_path_factory.mktemp("eagle3-gguf"), target, keep, layers=GGUF_LAYERS, heads=8,
                             kv_heads=2, head_dim=32)
    return target, load_draft(directory, target), directory


def test_beside_llamacpp_the_heads_matrices_are_q8_0_where_the_kernel_runs(gguf_eagle3, monkeypatch):
    """Beside llama.cpp the head's linear layers are multiplied as Q8_0 by specdec's kernel (where this CPU
    runs it): its rows stay within rounding of the float head's, and the lossless tests below run on it."""
    from specdec.runtime import cpu_head

    target, draft, directory = gguf_eagle3
    quantized = cpu_head.unavailable() is None
    assert isinstance(draft.net.lm_head, cpu_head.QuantizedLinear) == quantized
    assert isinstance(draft.net.midlayer.self_attn.q_proj, cpu_head.QuantizedLinear) == quantized
    if not quantized:
        pytest.skip(f"the kernel does not run here: {cpu_head.unavailable()}")
    monkeypatch.setattr(cpu_head, "unavailable", lambda: "off for this comparison")
    whole = load_draft(directory, target)
    assert isinstance(whole.net.lm_head, torch.nn.Linear) and whole.weight_bytes > 1.5 * draft.weight_bytes
    tokens = [1, 2, 3, 4, 5, 6, 7]
    rows, reference = (observed_head(head, target, tokens).forward(tokens)[1:] for head in (draft, whole))
    assert (rows - reference).abs().max() < 0.05 * reference.abs().max()
    assert (rows.argmax(-1) == reference.argmax(-1)).float().mean() > 0.8


def test_llamacpp_gives_the_same_layer_states_in_a_batch_and_alone(gguf_eagle3):
    """llama.cpp's states at the head's layers, copied out of its graph: every token's, in order, the
    same whether a text is fed at once or token by token (to llama.cpp's own batch-shape rounding)."""
    target, draft, _ = gguf_eagle3
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    target.keep_states(layers=draft.state_layers)
    try:
        together = target.sequence()
        together.forward(tokens, last=1)
        at_once = together.states
        alone = target.sequence()
        one_by_one = torch.cat([(alone.forward([token]), alone.states)[1] for token in tokens])
        together.release()
        alone.release()
    finally:
        target.keep_states(False)
    assert at_once.shape == (len(tokens), 3 * target.hidden_size)
    torch.testing.assert_close(at_once, one_by_one, rtol=0, atol=5e-2)
    assert not torch.allclose(at_once[:, : target.hidden_size], at_once[:, target.hidden_size: 2 * target.hidden_size])


def test_greedy_speculation_with_an_eagle3_head_equals_plain_greedy_llamacpp(gguf_eagle3, gguf_models):
    target, draft, directory = gguf_eagle3
    accepted = Counter()
    for prompt in GGUF_PROMPTS:
        plain = SpeculativeDecoder(target).generate(list(prompt), max_new_tokens=24, temperature=0).tokens
        for name, (drafter, gamma) in drafters_of(draft).items():
            result = SpeculativeDecoder(target, drafter, gamma).generate(list(prompt), max_new_tokens=24, temperature=0)
            assert result.tokens == plain, name
            accepted[name] += result.stats.accepted
    assert accepted["chain"] > 0, accepted


@pytest.mark.statistical
def test_sampled_speculation_with_an_eagle3_tree_follows_the_target_llamacpp(gguf_eagle3):
    """A tree (chains are a tree's special case; the transformers tests take both): 60 s on 2 cores."""
    from test_llamacpp import ALPHA, SAMPLES, chi_square, pruned_joint

    target, draft, _ = gguf_eagle3
    sampling = specdec.SamplingParams(temperature=1.0, top_k=3)
    prompt = list(GGUF_PROMPTS[0])
    decoder = SpeculativeDecoder(target, ModelDrafter(draft, tree=TreeShape(6, 2)), gamma=2)
    counts, drafted, accepted = Counter(), 0, 0
    for i in range(SAMPLES):
        result = decoder.generate(prompt, max_new_tokens=3, temperature=1.0, top_k=3, seed=10_000 + i)
        counts[tuple(result.tokens)] += 1
        drafted, accepted = drafted + result.stats.drafted, accepted + result.stats.accepted
    assert 0 < accepted < drafted
    assert chi_square(counts, pruned_joint(target, prompt, sampling, SAMPLES), SAMPLES) > ALPHA


# ------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("change, message", [
    (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}),
     r"reads the inputs of layers \[1, 2, 9\]; the target has 4"),
    (dict(target_hidden_size=48), "reads states 48 wide; the target's are 32"),
    (dict(vocab_size=300), "made for a vocabulary of 300 tokens; the target has 16"),
    (dict(draft_vocab_size=7), r"lm_head.weight is \[.*\], its config says \[7, 32\]"),
])
def test_a_head_that_does_not_fit_the_target_is_refused_saying_why(tiny_target, tmp_path, change, message):
    _, target = tiny_target
    directory = write_eagle3(tmp_path / "head", target, [1, 2, 3, 4, 5], **change)
    with pytest.raises(specdec.SpecDecError, match=message):
        load_draft(directory, target)


def test_a_head_whose_vocabulary_maps_are_wrong_is_refused(tiny_target, tmp_path):
    _, target = tiny_target
    directory = write_eagle3(tmp_path / "head", target, [1, 2, 3, 4, 5])
    from safetensors.torch import load_file

    tensors = load_file(str(directory / "model.safetensors"))
    tensors["d2t"] = torch.tensor([0, 0, 0, 0, 20])  # draft id 4 -> target id 24: beyond the vocabulary
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(specdec.SpecDecError, match="d2t does not map its 5 draft tokens"):
        load_draft(directory, target)
    tensors["d2t"] = torch.tensor([0, 0, 0, 0, 0])
    save_file(tensors, str(directory / "model.safetensors"))  # 0 .. 4, where t2d says 1 .. 5
    with pytest.raises(specdec.SpecDecError, match="t2d and d2t disagree"):
        load_draft(directory, target)


def test_the_default_layers_of_a_shallow_target_are_refused(tiny_target, tmp_path):
    """No layer ids in the config: 2, L // 2 and L - 3 of the target, which a 4-layer one cannot give."""
    _, target = tiny_target
    with pytest.raises(specdec.SpecDecError, match=r"reads the inputs of layers \[2, 2, 1\]"):
        load_draft(write_eagle3(tmp_path / "head", target, [1, 2, 3], layers=None), target)


# ------------------------------------------------------------------------------ training


def test_training_time_test_computes_what_drafting_computes(hf_eagle3):
    """The unrolled training forward's step k, row t - 1, is the head's row for the k-th token drafted
    after committed text ending at position t: the training math is the drafting math."""
    from specdec.distill_eagle3 import STEPS_AHEAD, Unrolled, _prefill

    target, draft, _ = hf_eagle3
    window = [1, 2, 3, 5, 9, 2, 6, 5, 3, 7, 1, 4]
    target.keep_states(layers=draft.state_layers)
    try:
        prefills = _prefill(target, [torch.tensor(window).numpy()], 4, [None])
    finally:
        target.keep_states(False)
    prefills.states = layer_states(draft, target, window).numpy()[None]  # as observed below, not rounded to float16
    unrolled = Unrolled(draft.net, prefills, torch.arange(target.vocab_size))
    with torch.no_grad():
        steps = unrolled.logits(*[x.float() if x.is_floating_point() else x for x in unrolled.batch([0])[:2]])
    assert len(steps) == STEPS_AHEAD
    for t in (3, 6):
        head = draft.sequence()
        head.observe(0, layer_states(draft, target, window[:t]))  # the target's states up to t - 1
        rows = head.forward(window[: t + STEPS_AHEAD])  # the text to t, then the next tokens as a drafted chain
        for k in range(STEPS_AHEAD):
            torch.testing.assert_close(steps[k][0, t - 1].float(), rows[t + k], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model", ["gguf-q8_0", "gguf-f16"])
def test_the_prefills_top_k_over_the_draft_vocabulary_is_the_whole_logits_restricted_to_it(gguf_models, model):
    """Where specdec's output layer takes the model's output matrix (Q8_0 here, on a CPU its kernel runs
    on), llama.cpp narrows it to the draft vocabulary's rows; elsewhere (f16) the whole logits are
    indexed. Either way the top-k is the whole vocabulary's logits restricted to those columns, the
    states are the same, and the logits are whole again after."""
    from specdec.distill_eagle3 import _prefill
    from specdec.runtime import cpu_head

    target = specdec.load_model(gguf_models[model], threads=1)
    ids = np.arange(3, target.vocab_size, 7)
    window = np.array([1, 5, 9, 200, 31, 7, 7, 40, 2, 11])
    target.keep_states(layers=(1,))
    try:
        whole = target.sequence()
        logits = whole.forward(window.tolist())
        states = whole.states
        whole.release()
        expected = logits[:, torch.from_numpy(ids)].topk(4, dim=-1)
        narrowed = _prefill(target, [window], 4, [ids])
        assert target.narrow_output(ids) == (model == "gguf-q8_0" and cpu_head.unavailable() is None)
    finally:
        target.keep_states(False)
        target.narrow_output(None)
    assert (narrowed.top_ids[0] == ids[expected.indices.numpy()]).all()
    torch.testing.assert_close(torch.from_numpy(narrowed.top_logits[0]).float(), expected.values,
                               rtol=2e-3, atol=1e-3 * float(logits.abs().max()))
    assert torch.equal(torch.from_numpy(narrowed.states[0]).view(torch.bfloat16), states.to(torch.bfloat16))
    check = target.sequence()
    assert check.forward([1, 2]).shape == (2, target.vocab_size)
    check.release()


def test_the_cli_trains_an_eagle3_head_that_generate_takes_and_resumes(tiny_target, tmp_path):
    """`specdec train --distill-from T --head` on a tiny target: the head it writes (EAGLE-3 layout)
    loads and drafts losslessly; the same command again resumes from the saved checkpoint."""
    import subprocess
    import sys

    target_dir, target = tiny_target
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("abc def ghi jkl mabc defg hij klm " * 200)
    out = tmp_path / "head"
    command = [sys.executable, "-m", "specdec", "train", str(corpus), "--distill-from", target_dir, "--head",
               "-o", str(out), "--prompts", "24", "--prompt-tokens", "24", "--steps", "6", "--eval-every", "3",
               "--save-every", "3", "--batch-size", "4", "--draft-vocab", "12", "--holdout", "0.1", "--threads", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "held-out agreement with the target's greedy choice by depth" in done.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 12
    report = json.loads((out / "eagle3.json").read_text())
    assert report["steps"] == 6 and len(report["heldout_agreement_by_depth"]) == 4
    draft = load_draft(out, target)
    assert isinstance(draft, Eagle3Model)
    for prompt in PROMPTS:
        decoder = SpeculativeDecoder(target, ModelDrafter(draft), 3)
        result = decoder.generate(list(prompt), max_new_tokens=16, temperature=0)
        assert result.tokens == reference_greedy(target, list(prompt), 16)
    again = subprocess.run(command[:-8] + ["--steps", "9"] + command[-6:], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads((out / "eagle3.json").read_text())["steps"] == 9


# ------------------------------------------------------------------------------ where it computes


def test_in_bfloat16_the_heads_rotary_frequencies_stay_float32(hf_eagle3, tiny_target):
    """Beside a bfloat16 target the head computes in bfloat16, but its rotary frequencies stay as trained
    (float32, as transformers keeps a model's): rounded, a position's angle drifts by radians within a
    few thousand positions."""
    target_dir, _ = tiny_target
    _, draft, directory = hf_eagle3
    half = load_draft(directory, specdec.load_model(target_dir, device="cpu", dtype="bfloat16"))
    assert half.net.dtype == torch.bfloat16
    for name, frequencies in draft.net.rotary.named_buffers():
        kept = getattr(half.net.rotary, name)
        assert kept.dtype == torch.float32 and torch.equal(kept, frequencies.float()), name
    position = torch.tensor([[3000]])
    cos, _ = half.net.rotary(torch.zeros(1, 1, 1, dtype=torch.float32), position)
    want, _ = draft.net.rotary(torch.zeros(1, 1, 1, dtype=torch.float32), position)
    torch.testing.assert_close(cos, want.float(), rtol=0, atol=1e-5)


def test_the_head_computes_on_its_targets_device(hf_eagle3, monkeypatch):
    """Beside a target on a GPU the head computes there, the states the target reports moved to it and its
    logits brought back to the host. Checked on the "meta" device, which holds no data and mixes with no
    other device: any tensor of a level left on the CPU (a token, a position, the mask, a cache row, a
    state) fails the forward. A prefill, a tree, a kept path and its nodes read again, as a generation
    runs them."""
    from specdec.runtime import base, eagle3

    target, draft, _ = hf_eagle3
    net = eagle3.Eagle3Net(draft.net.config, draft.net.embed_tokens)
    head_model = Eagle3Model(net, target, draft.state_layers, device=torch.device("meta"), dtype=torch.float32)
    assert (head_model.device, head_model.on_gpu, head_model.columns.device.type) == ("meta", False, "cpu")
    returned = []

    def to_host(logits):
        returned.append(logits.device.type)
        return torch.zeros(logits.shape)
    monkeypatch.setattr(base, "to_host", to_host)
    states = lambda n: torch.zeros(n, 3 * target.hidden_size, dtype=torch.float64)  # from the host, as a prefill's
    prefix, path = [1, 2, 3, 1, 5, 9], [2, 6, 5]
    s = len(prefix) - 1
    head = head_model.sequence()
    head.observe(0, states(s))
    head.forward(prefix[:-1])
    head.forward(prefix[-1:] + path + [7], [s - 1, s, s + 1, s + 2, s + 1])
    head.keep(len(prefix), [s + 1, s + 2])
    head.observe(s, states(3).to("meta"))  # a verify's, on the target's device
    assert head.forward([path[2], 4]).shape == (2, len(head_model.columns))
    assert returned == ["meta"] * 3


def test_a_head_without_embeddings_of_its_own_reads_the_targets_tensor_not_a_copy(hf_eagle3, tiny_target):
    """A head in the "eagle3" layout ships no embed_tokens and reads the target's: on the device and in the
    precision where the target already keeps them, the same memory (an 8B target's are 1 GB), the tensor
    left as it was: beside a float64 target and beside a bfloat16 one (the head computes in its target's dtype)."""
    target_dir, _ = tiny_target
    target, draft, directory = hf_eagle3
    own = target.model.get_input_embeddings().weight
    before = own.detach().clone()
    shares = draft.net.embed_tokens.untyped_storage().data_ptr() == own.untyped_storage().data_ptr()
    assert shares == (draft.net.config.layout == "eagle3")
    assert torch.equal(own, before) and own.dtype == torch.float64
    half_target = specdec.load_model(target_dir, device="cpu", dtype="bfloat16")
    half = load_draft(directory, half_target)
    assert half.net.embed_tokens.dtype == torch.bfloat16
    assert (half.net.embed_tokens.untyped_storage().data_ptr()
            == half_target.model.get_input_embeddings().weight.untyped_storage().data_ptr()) == shares
