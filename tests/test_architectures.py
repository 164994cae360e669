"""The architecture matrix: every family in `architectures.ARCHITECTURES`, built tiny, saved and loaded
through the real loader in float64, either decodes exactly or refuses what it cannot do.

For each architecture:
- plain greedy decoding equals Hugging Face `generate` greedy up to the end of the context;
- every drafter (draft-model chain, token tree, staged chain and tree, prompt lookup, n-gram) gives
  the plain greedy tokens, over a generation that runs into the context limit;
- for each attention implementation the model loads with (eager, sdpa), the 2-node tree self-check
  gives the verdict a 7-node tree confirms: trees are exact, or they are refused by name and
  would indeed have been wrong.
A sampled tree on a model that runs eager attention (Gemma2) matches the target's exact joint
distribution of three tokens (chi-square).
"""

from __future__ import annotations

import re

import pytest
import torch

import specdec
import specdec.runtime
from specdec.runtime.base import Feed
from specdec.runtime.prefix import PrefixCache
from specdec.runtime.hf import HFModel
from architectures import ARCHITECTURES
from specdec import tree
from reference import path_to
from specdec.katz import KatzTrigram
from tiny import save_tiny_model

pytestmark = pytest.mark.architectures

PROMPT = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]  # repeats, so prompt lookup has drafts to offer
CONTEXT = 64  # every tiny config's context but Bloom's, which sets none (specdec then assumes 2048)
NEW = 100  # more than the context holds: generations run into its end
TREES_REFUSED = {"bloom": "ALiBi", "falcon-alibi": "ALiBi", "mpt": "ALiBi", "gpt_neo": "its local-attention window"}
# a 7-node tree below a prefix longer than the tiny sliding windows (8)
TREE_TOKENS, TREE_PARENTS = [4, 5, 6, 7, 8, 9, 10], [-1, 0, -1, 1, 1, 2, 3]
TREE_PREFIX = [1, 2, 3, 1, 5, 9, 2, 6, 5, 3, 5]


@pytest.fixture(scope="module")
def arch_dirs(tmp_path_factory) -> dict[str, str]:
    """A 2-layer target and a near copy (perturbed weights: agrees often, not always) per architecture."""
    root = tmp_path_factory.mktemp("architectures")
    dirs = {}
    for seed, arch in enumerate(ARCHITECTURES):
        dirs[arch] = str(save_tiny_model(root / arch, arch, seed=seed))
        dirs[f"{arch}-near"] = str(save_tiny_model(root / f"{arch}-near", arch, seed=seed, noise=0.005))
    return dirs


def load(directory: str, **options) -> specdec.CausalLM:
    return specdec.load_model(directory, device="cpu", dtype="float64", **options)


def load_or_skip(directory: str, arch: str, implementation: str) -> specdec.CausalLM:
    try:
        return load(directory, attn_implementation=implementation)
    except specdec.SpecDecError as error:
        if "does not support an attention implementation" in str(error):
            pytest.skip(f"transformers has no {implementation} attention for {arch}")
        raise


def hf_greedy(model: specdec.CausalLM, prompt: list[int], new: int) -> list[int]:
    with torch.inference_mode():
        ids = torch.tensor([prompt])  # the mask says every token counts: without it, generate masks tokens equal to pad_token_id
        out = model.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                                   eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def drafters(directory: str, plain: list[int]) -> dict:
    ngram = KatzTrigram.build([PROMPT + plain], vocab_size=16)
    return {
        "chain": specdec.ModelDrafter(load(directory)),
        "tree": specdec.ModelDrafter(load(directory), tree=specdec.TreeShape(nodes=8, width=2)),
        "staged": specdec.ModelDrafter(load(directory), inner=specdec.PromptLookupDrafter(), inner_gamma=2),
        "staged-tree": specdec.ModelDrafter(load(directory), tree=specdec.TreeShape(nodes=6, width=2),
                                            inner=specdec.PromptLookupDrafter(), inner_gamma=2),
        "prompt-lookup": specdec.PromptLookupDrafter(),
        "auto": specdec.AutoDrafter(specdec.ModelDrafter(load(directory)), specdec.PromptLookupDrafter()),
        "ngram": specdec.NgramDrafter(ngram, stochastic=True),
    }


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_plain_and_every_drafter_match_hugging_face_greedy(arch, arch_dirs):
    target = load(arch_dirs[arch])
    plain = specdec.SpeculativeDecoder(target).generate(PROMPT, max_new_tokens=NEW, temperature=0)
    assert len(plain.tokens) == min(NEW, target.max_length - len(PROMPT))
    assert target.max_length == CONTEXT or arch == "bloom"
    assert plain.tokens == hf_greedy(target, PROMPT, len(plain.tokens)), "plain greedy differs from HF generate"
    for name, drafter in drafters(arch_dirs[f"{arch}-near"], plain.tokens).items():
        if getattr(drafter, "tree", None) is not None and arch in TREES_REFUSED:
            with pytest.raises(specdec.SpecDecError, match=rf"does not support token trees \({TREES_REFUSED[arch]}.*\); use a chain"):
                specdec.SpeculativeDecoder(target, drafter, gamma=3)
            continue
        result = specdec.SpeculativeDecoder(target, drafter, gamma=3).generate(PROMPT, max_new_tokens=NEW, temperature=0)
        assert result.tokens == plain.tokens, f"{name} differs from plain greedy"
        assert result.stats.accepted > 0, f"{name} never had a draft token accepted: the test would prove little"
    # the default with a prediction: the plain output's text with its middle third cut out
    text = target.tokenizer.decode(plain.tokens)
    predicted = specdec.SpeculativeDecoder(target, drafters(arch_dirs[f"{arch}-near"], plain.tokens)["auto"]).generate(
        PROMPT, max_new_tokens=NEW, temperature=0, prediction=text[: len(text) // 3] + text[2 * len(text) // 3 :])
    assert predicted.tokens == plain.tokens, "the default with a prediction differs from plain greedy"
    assert predicted.stats.source_trials["prediction"][1] > 0, "no predicted token was accepted: the test would prove little"
    # the default with a history of an earlier request: the same prompt, its output with one token changed
    history = specdec.History()
    half = len(plain.tokens) // 2
    history.record(None, PROMPT + plain.tokens[:half] + [(plain.tokens[half] + 1) % 16] + plain.tokens[half + 1 :])
    recalled = specdec.SpeculativeDecoder(target, drafters(arch_dirs[f"{arch}-near"], plain.tokens)["auto"], history=history).generate(
        PROMPT, max_new_tokens=NEW, temperature=0)
    assert recalled.tokens == plain.tokens, "the default with a history differs from plain greedy"
    assert recalled.stats.source_trials["history"][1] > 0, "no token from the history was accepted: the test would prove little"
    # a second turn that starts from the first turn's kept cache (prefix reuse)
    reusing = specdec.SpeculativeDecoder(target, drafters(arch_dirs[f"{arch}-near"], plain.tokens)["auto"],
                                         prefix_cache=PrefixCache(target, 4096, min_shared=4))
    first = reusing.generate(PROMPT, max_new_tokens=20, temperature=0)
    follow = PROMPT + first.tokens + [6, 7]
    second = reusing.generate(follow, max_new_tokens=NEW, temperature=0)
    assert second.stats.cached_tokens == len(PROMPT) + len(first.tokens) - 1, "the second turn did not start from the first's cache"
    assert second.tokens == hf_greedy(target, follow, len(second.tokens)), "a turn from a kept prefix differs from HF greedy"


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tree_self_check_per_attention_implementation(arch, implementation, arch_dirs):
    """The self-check's verdict, confirmed by a 7-node tree whose every node must match its path alone."""
    model = load_or_skip(arch_dirs[arch], arch, implementation)
    assert model.attn_implementation == implementation
    refusal = model.tree_refusal()
    exact = seven_node_tree_is_exact(model)
    if arch in TREES_REFUSED:
        assert refusal is not None and TREES_REFUSED[arch] in refusal
        assert not exact, "refused, yet a tree would have been exact"
        with pytest.raises(specdec.SpecDecError, match="does not support token trees"):
            specdec.runtime.require_trees(model)
    else:
        assert refusal is None and exact


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_batched_forward_equals_each_row_alone(arch, implementation, arch_dirs):
    """Rows with different cache lengths (one empty), a chain continuation, a prefill and a tree,
    in one forward: every row's logits equal its own forward alone (where a model cannot take
    padding exactly, its rows go one at a time: still equal)."""
    model = load_or_skip(arch_dirs[arch], arch, implementation)
    parents = tree.entries(TREE_PARENTS, len(TREE_PREFIX) - 1)
    first = (TREE_PREFIX, TREE_TOKENS, parents if model.tree_refusal() is None else None)  # no trees where they are refused
    rows = [first, (PROMPT[:3], [7, 8], None), ([], PROMPT, None), (PROMPT, [9], None)]
    batched, alone = [model.sequence() for _ in rows], [model.sequence() for _ in rows]
    for sequence, (prefix, _, _) in zip(batched + alone, rows + rows):
        if prefix:
            sequence.forward(prefix)
    got = model.forward_batch([Feed(s, tokens, p) for s, (_, tokens, p) in zip(batched, rows)])
    for sequence, logits, (_, tokens, p) in zip(alone, got, rows):
        torch.testing.assert_close(logits, sequence.forward(tokens, p), rtol=0, atol=1e-6)
    follow = model.forward_batch([Feed(s, [3]) for s in batched[1:]])  # the caches written by the batch are right too
    for sequence, logits in zip(alone[1:], follow):
        torch.testing.assert_close(logits, sequence.forward([3]), rtol=0, atol=1e-6)


def seven_node_tree_is_exact(model: specdec.CausalLM) -> bool:
    parents = torch.tensor(TREE_PARENTS)
    sequence = model.sequence()
    sequence.forward(TREE_PREFIX)
    try:
        tree_logits = sequence.forward(TREE_TOKENS, tree.entries(TREE_PARENTS, len(TREE_PREFIX) - 1))
    except Exception:
        return False
    for node in range(len(TREE_TOKENS)):
        alone = model.sequence().forward(TREE_PREFIX + [TREE_TOKENS[i] for i in path_to(parents, node)])[-1]
        if not torch.allclose(tree_logits[node], alone, rtol=0, atol=1e-6):
            return False
    return True


def test_a_sampled_tree_on_an_eager_attention_model_keeps_the_target_distribution(arch_dirs):
    """Finding: eager attention adds the mask to the scores, so a boolean tree mask masked nothing and
    a sampled tree's distribution was far from the target's (TV ~ 0.5). Gemma2 loads with eager."""
    from test_statistical import ALPHA, PROMPT as JOINT_PROMPT, SAMPLES, chi_square_pvalue, exact_joint, sample_joint

    target = load(arch_dirs["gemma2"])
    assert target.attn_implementation == "eager"
    drafter = specdec.ModelDrafter(load(arch_dirs["gemma2-near"]), tree=specdec.TreeShape(nodes=6, width=2))
    decoder = specdec.SpeculativeDecoder(target, drafter, gamma=2)
    sampling = dict(temperature=1.0)
    counts, drafted, accepted = sample_joint(decoder, sampling, base_seed=50_000)
    assert 0 < accepted < drafted
    assert chi_square_pvalue(counts, exact_joint(target, specdec.SamplingParams(**sampling)), SAMPLES) > ALPHA
    assert len(JOINT_PROMPT) + 3 < CONTEXT


def test_longrope_recomputes_the_cache_when_the_context_crosses_the_switch(arch_dirs):
    """Finding: Phi-3's longrope runs every position on its long factors once the sequence is longer
    than original_max_position_embeddings, and Hugging Face recomputes the cache then; a kept cache
    gave other logits from the switch on. Each next-token distribution, fed as the engine feeds it
    (prefill, then one token), must equal a no-cache forward of the whole sequence."""
    model = load(arch_dirs["phi3-longrope"])
    switch = model.rope_switch
    assert switch == CONTEXT // 2
    sequence = [(7 * i) % 16 for i in range(switch + 4)]
    for length in range(switch - 2, switch + 4):
        fed = model.sequence()
        fed.forward(sequence[: length - 1])
        logits = fed.forward(sequence[length - 1 : length])[-1]
        with torch.inference_mode():
            expected = model.model(torch.tensor([sequence[:length]])).logits[0, -1]
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-8, msg=f"sequence length {length}")
    # one verify never straddles the switch: nodes before it run short factors, after it long
    assert [model.verify_room(root) for root in (switch - 4, switch - 1, switch)] == [3, 0, CONTEXT - 1 - switch]


def test_longrope_rows_on_both_sides_of_the_switch_are_not_batched_together(arch_dirs):
    """Finding (review): longrope takes its factors from the largest position in the batch, so a
    row below the switch beside one past it got the long factors. Each row must equal itself alone."""
    model = load(arch_dirs["phi3-longrope"])
    text = [(7 * i) % 16 for i in range(model.rope_switch + 6)]
    rows = [(text[: model.rope_switch + 3], [3]), (text[:5], [4, 5]), (text[:9], [6])]
    batched, alone = [model.sequence() for _ in rows], [model.sequence() for _ in rows]
    for sequence, (prefix, _) in zip(batched + alone, rows + rows):
        sequence.forward(prefix)
    got = model.forward_batch([Feed(s, tokens) for s, (_, tokens) in zip(batched, rows)])
    for sequence, logits, (_, tokens) in zip(alone, got, rows):
        torch.testing.assert_close(logits, sequence.forward(tokens), rtol=0, atol=1e-10)
    short = model.forward_batch([Feed(s, [2]) for s in batched[1:]])  # rows all below the switch still share a forward
    for sequence, logits in zip(alone[1:], short):
        torch.testing.assert_close(logits, sequence.forward([2]), rtol=0, atol=1e-10)


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    from specdec.cli import main

    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def cli_tokens(capsys, *argv, dtype: str = "float64") -> list[int]:
    import json

    code, out, err = run_cli(capsys, "generate", "abcab", "--device", "cpu", "--dtype", dtype, "--json", *argv)
    assert code == 0, err
    return json.loads(out)["tokens"]


def test_cli_refuses_trees_on_alibi_with_a_clear_error(arch_dirs, capsys):
    """Finding: a tree on Falcon with alibi=True ended in a raw `ValueError: too many values to unpack`."""
    code, out, err = run_cli(capsys, "generate", "abc", "--target", arch_dirs["falcon-alibi"], "--draft",
                             arch_dirs["falcon-alibi-near"], "--tree", 8, "--depth", 3, "--temperature", 0)
    last = err.strip().splitlines()[-1]  # (transformers' loading bars come before it)
    assert code == 1 and out == "" and "Traceback" not in err
    assert last.startswith("specdec: error: ") and "does not support token trees (ALiBi" in last and last.endswith("use a chain")
    chain = cli_tokens(capsys, "--target", arch_dirs["falcon-alibi"], "--draft", arch_dirs["falcon-alibi-near"], "--temperature", 0)
    assert chain == cli_tokens(capsys, "--target", arch_dirs["falcon-alibi"], "--temperature", 0)


@pytest.mark.parametrize("arch, implementation", [("gemma2", None), ("gptj", None), ("llama", "eager"), ("qwen3", "sdpa")])
def test_cli_tree_output_equals_plain_under_each_attention_implementation(arch, implementation, arch_dirs, capsys):
    """The finding's repro: `generate --temperature 0` with and without `--draft D --tree 8 --depth 3`."""
    chosen = ["--attn-implementation", implementation] if implementation else []
    plain = cli_tokens(capsys, "--target", arch_dirs[arch], "--temperature", 0, "--max-new-tokens", 40, *chosen)
    tree_tokens = cli_tokens(capsys, "--target", arch_dirs[arch], "--draft", arch_dirs[f"{arch}-near"], "--tree", 8, "--depth", 3,
                             "--temperature", 0, "--max-new-tokens", 40, *chosen)
    assert tree_tokens == plain and len(plain) == 40


@pytest.mark.parametrize("extreme", [["--temperature", "1e-300"], ["--top-p", "5e-324"], ["--temperature", "1e-45", "--top-p", "1e-310"]])
def test_cli_vanishing_temperature_or_top_p_decodes_greedily(extreme, arch_dirs, capsys):
    """Finding: `--temperature 1e-300` underflowed to NaN in float32 (the CPU default) and the sampler
    repeated the last vocabulary id. Its limit is greedy decoding."""
    target, near = arch_dirs["llama"], arch_dirs["llama-near"]
    greedy = cli_tokens(capsys, "--target", target, "--temperature", 0, "--max-new-tokens", 30, dtype="float32")
    for seed, drafter in enumerate([[], ["--draft", near], ["--draft", near, "--tree", 6]]):
        tokens = cli_tokens(capsys, "--target", target, *drafter, "--max-new-tokens", 30, "--seed", seed, *extreme, dtype="float32")
        assert tokens == greedy, drafter


def test_bench_skips_token_trees_on_a_model_that_refuses_them(arch_dirs, capsys):
    from specdec.bench.runner import BenchConfig, tree_strategies

    strategies = tree_strategies(BenchConfig(), load(arch_dirs["bloom"]), load(arch_dirs["bloom-near"]), None)
    assert [s.name for s in strategies] == ["staged γ=3 (lookup)"]
    assert "token-tree strategies skipped: ALiBi" in capsys.readouterr().err
    with_trees = tree_strategies(BenchConfig(), load(arch_dirs["llama"]), load(arch_dirs["llama-near"]), None)
    assert [s.family for s in with_trees] == ["tree"] * 3 + ["staged"] * 2


def test_the_self_check_refuses_a_mask_that_attention_ignores(arch_dirs, monkeypatch):
    """With the old boolean mask, eager attention (which adds the mask to its scores) masked nothing:
    the self-check must see that and refuse trees, while sdpa (which reads booleans) still passes."""
    monkeypatch.setattr(HFModel, "_additive", lambda model, mask: mask.to(model.device)[:, None])
    eager = load(arch_dirs["gemma2"])
    assert "differ from its paths computed alone" in eager.tree_refusal()
    drafter = specdec.ModelDrafter(load(arch_dirs["gemma2-near"]), tree=specdec.TreeShape(nodes=4))
    with pytest.raises(specdec.SpecDecError, match=r"\(gemma2, eager attention\) does not support token trees"):
        specdec.SpeculativeDecoder(eager, drafter, gamma=2)
    assert load(arch_dirs["llama"], attn_implementation="sdpa").tree_refusal() is None


@pytest.mark.parametrize("way", ["graphs", "static"])
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_static_slots_decode_as_the_eager_path(arch, implementation, way, arch_dirs):
    """The static pool (`specdec.runtime.static`, the GPU default) on every architecture and attention
    implementation, its forwards padded to the compiled shapes (graphs: as a GPU runs them, uncaptured on the
    CPU) and as they come (static): plain decoding and every drafter give the eager path's plain greedy tokens; a
    model it cannot take is refused by name when asked for."""
    from specdec.runtime.static import StaticHFModel, static_refusal

    eager = load_or_skip(arch_dirs[arch], arch, implementation)
    refusal = static_refusal(eager.model.config)
    if refusal is not None:
        with pytest.raises(specdec.SpecDecError, match=rf"no static cache for this model \({re.escape(refusal)}\)"):
            load(arch_dirs[arch], compile=way, attn_implementation=implementation)
        return
    static = load(arch_dirs[arch], compile=way, attn_implementation=implementation)
    assert isinstance(static, StaticHFModel)
    plain = specdec.SpeculativeDecoder(eager).generate(PROMPT, max_new_tokens=NEW, temperature=0).tokens
    assert specdec.SpeculativeDecoder(static).generate(PROMPT, max_new_tokens=NEW, temperature=0).tokens == plain
    for name, drafter in drafters(arch_dirs[f"{arch}-near"], plain).items():
        if name in ("chain", "tree", "prompt-lookup", "auto"):
            result = specdec.SpeculativeDecoder(static, drafter, gamma=3).generate(PROMPT, max_new_tokens=NEW, temperature=0)
            assert result.tokens == plain, f"{name} on static slots differs from plain greedy"
