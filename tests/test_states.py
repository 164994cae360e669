"""The target's states (`CausalLM.keep_states`) on the transformers runtimes, eager and static.

Each state a forward leaves on a sequence must be the final norm's output of a fresh no-cache
forward over that row's path (a chain's rows, a `last=k` call's k rows, a tree's nodes, each row
of a batch of two), and the output layer applied to it (soft-capping and scaling included) must
give exactly the logits returned beside it. The references differ from row to row far beyond the
tolerance, so a state of the wrong row fails. Float64 models, compared as the runtime tests do.
"""

from __future__ import annotations

import pytest
import torch

import specdec
from architectures import ARCHITECTURES
from specdec import tree
from reference import path_to
from specdec.runtime.base import Feed
from tiny import save_tiny_model

PREFIX = [1, 2, 3, 1, 5, 9, 2, 6, 5, 3, 5]  # longer than the tiny sliding windows (8)
TREE_TOKENS, TREE_PARENTS = [4, 5, 6, 7, 8, 9, 10], [-1, 0, -1, 1, 1, 2, 3]  # two branches, a fork, depth 3
ATOL = 1e-10  # float64 under sdpa: a tree node's logits are this close to its path's alone (test_runtime)
HANDFUL = ["llama", "mistral", "gemma2", "gpt2", "granite", "cohere"]  # windows, soft-capping, learned positions, logit scaling


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A directory per architecture, made when first asked for."""
    root, made = tmp_path_factory.mktemp("states"), {}

    def save(arch: str) -> str:
        if arch not in made:
            made[arch] = str(save_tiny_model(root / arch, arch, seed=list(ARCHITECTURES).index(arch)))
        return made[arch]

    return save


def load(directory: str, arch: str, **options) -> specdec.CausalLM:
    try:
        return specdec.load_model(directory, device="cpu", dtype="float64", **options)
    except specdec.SpecDecError as error:
        if "does not support an attention implementation" in str(error):
            pytest.skip(f"transformers has no {options.get('attn_implementation')} attention for {arch}")
        raise


def final_norm_output(model, path: list[int]) -> torch.Tensor:
    """[hidden]: the last row of the base model's output over `path` alone, no cache (the reference)."""
    with torch.inference_mode():
        return model.model.base_model(input_ids=torch.tensor([path])).last_hidden_state[0, -1]


def output_layer(model, states: torch.Tensor) -> torch.Tensor:
    """[rows, vocab]: the logits the architecture makes of states (what its CausalLM does after the
    base model), written out here rather than taken from the runtime."""
    config = model.model.config
    with torch.inference_mode():
        logits = model.model.get_output_embeddings()(states)[:, : model.vocab_size]
    if getattr(config, "logit_scale", None):  # Cohere
        logits = logits * config.logit_scale
    if getattr(config, "logits_scaling", None):  # Granite
        logits = logits / config.logits_scaling
    if getattr(config, "final_logit_softcapping", None):  # Gemma 2 and 3
        logits = config.final_logit_softcapping * torch.tanh(logits / config.final_logit_softcapping)
    return logits


def check_states(model, sequence, logits: torch.Tensor, paths: list[list[int]]) -> None:
    """`sequence.states`, just left by the forward that returned `logits`, are the paths' final-norm outputs."""
    states = sequence.states
    assert states is not None and states.shape == (len(paths), model.hidden_size)
    assert states.dtype == logits.dtype and states.device == logits.device
    want = torch.stack([final_norm_output(model, path) for path in paths])  # [rows, hidden]
    atol = ATOL if model.attn_implementation == "sdpa" else model.tree_tolerance
    apart = (want[:, None] - want[None]).abs().amax(-1) + torch.eye(len(paths), dtype=want.dtype)  # [rows, rows]
    assert float(apart.min()) > 100 * atol, "two rows' references are too close for a wrong row to be caught"
    torch.testing.assert_close(states.cpu(), want, rtol=0, atol=atol)
    torch.testing.assert_close(output_layer(model, states).cpu(), logits.cpu(), rtol=0, atol=ATOL)


def tree_paths(prefix: list[int]) -> list[list[int]]:
    parents = torch.tensor(TREE_PARENTS)
    return [prefix + [TREE_TOKENS[i] for i in path_to(parents, node)] for node in range(len(TREE_TOKENS))]


def tree_parents(prefix: list[int]) -> list[int]:
    return tree.entries(TREE_PARENTS, len(prefix) - 1)


def check_every_kind_of_forward(model) -> None:
    """Off by default; then a chain, a `last=k` call, a tree and a batch of two; then off again."""
    trees = model.tree_refusal() is None
    sequence = model.sequence()
    sequence.forward(PREFIX)
    assert sequence.states is None, "states kept before keep_states"
    assert not model.model.get_output_embeddings()._forward_pre_hooks, "something is taken while states are off"
    sequence.truncate(0)
    model.keep_states()
    check_states(model, sequence, sequence.forward(PREFIX), [PREFIX[: i + 1] for i in range(len(PREFIX))])
    check_states(model, sequence, sequence.forward([4, 5, 6], last=2), [PREFIX + [4, 5], PREFIX + [4, 5, 6]])
    sequence.truncate(len(PREFIX))
    if trees:
        check_states(model, sequence, sequence.forward(TREE_TOKENS, tree_parents(PREFIX)), tree_paths(PREFIX))
    other = model.sequence()
    other.forward(PREFIX[:5])
    sequence.truncate(len(PREFIX))
    feeds = [Feed(sequence, TREE_TOKENS, tree_parents(PREFIX), on_device=model.device_logits) if trees else Feed(sequence, [7, 8]),
             Feed(other, [7, 8, 9], last=1)]
    wanted = [tree_paths(PREFIX) if trees else [PREFIX + [7], PREFIX + [7, 8]], [PREFIX[:5] + [7, 8, 9]]]
    for feed, logits, paths in zip(feeds, model.forward_batch(feeds), wanted):
        check_states(model, feed.sequence, logits, paths)
    model.keep_states(False)
    for feed in feeds:
        feed.sequence.truncate(feed.sequence.cache_len - len(feed.tokens))
    model.forward_batch(feeds)
    assert sequence.states is None and other.states is None, "states kept after keep_states(False)"
    sequence.forward([1])
    assert sequence.states is None
    assert not model.model.get_output_embeddings()._forward_pre_hooks
    for s in (sequence, other):
        s.release()


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", HANDFUL)
def test_states_are_the_final_norm_output_of_each_rows_path(arch, implementation, saved):
    check_every_kind_of_forward(load(saved(arch), arch, attn_implementation=implementation))


@pytest.mark.parametrize("arch, compile", [("llama", "static"), ("mistral", "static"), ("gemma2", "static"),
                                           ("llama", "graphs"), ("mistral", "graphs"), ("gemma2", "graphs"),
                                           ("llama", "aot_eager")])
def test_the_static_pool_returns_states_from_its_compiled_forward(arch, compile, saved):
    """The same checks on the pool: the states come out of the forward that runs per shape (the
    graphs' buffers, torch.compile's trace) and of one that runs as it comes (static: nothing compiled nor
    padded); in the batch one row's logits stay on the device."""
    model = load(saved(arch), arch, compile=compile)
    check_every_kind_of_forward(model)
    if compile == "aot_eager":
        assert model.compile_seconds, "nothing ran compiled"


def test_states_across_the_longrope_switch(saved):
    """The first forward past longrope's switch feeds the cache again: its states, as its logits,
    are the new rows of one forward over the whole text."""
    model = load(saved("phi3-longrope"), "phi3-longrope")
    model.keep_states()
    text = [(7 * i) % 15 + 1 for i in range(model.rope_switch + 3)]
    before = model.rope_switch - 2
    for last in (None, 2):
        sequence = model.sequence()
        sequence.forward(text[:before])
        logits = sequence.forward(text[before:], last=last)
        with torch.inference_mode():
            whole = model.model.base_model(input_ids=torch.tensor([text])).last_hidden_state[0]  # [len(text), hidden]
        returned = whole[before:] if last is None else whole[-last:]
        assert sequence.states.shape == returned.shape
        torch.testing.assert_close(sequence.states, returned, rtol=0, atol=ATOL)
        torch.testing.assert_close(output_layer(model, sequence.states), logits, rtol=0, atol=ATOL)


def test_a_model_without_a_linear_output_layer_is_refused(saved, monkeypatch):
    model = load(saved("llama"), "llama")
    monkeypatch.setattr(model.model, "get_output_embeddings", lambda: None)
    with pytest.raises(specdec.SpecDecError, match="no hidden states"):
        model.keep_states()


@pytest.mark.architectures
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_states_on_every_architecture(arch, implementation, saved):
    """Where trees are refused (ALiBi, windows by slot), chains only."""
    check_every_kind_of_forward(load(saved(arch), arch, attn_implementation=implementation))
