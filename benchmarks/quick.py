"""A quick plain-vs-speculative timing on a synthetic pair, until `specdec bench` exists.

The pair: a random Llama target (byte-level BPE tokenizer trained on CPython's standard library)
and a draft made of the target's own embeddings, first layer, final norm and head ("layer skip").
The target's deeper layers are scaled down to small corrections of layer 0's output (DEPTH_SCALE),
which sets the acceptance rate: this measures the engine's overheads and the speedup at a given
acceptance, not a trained pair's quality (that is `specdec bench` on the demo pair).

    python benchmarks/quick.py [--out DIR] [--new 64] [--rounds 3]

Strategies run interleaved prompt by prompt after a warm-up; medians and ratios to plain decoding
from the same run are printed as a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sysconfig
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import specdec

DEPTH_SCALE = 0.05
PROMPTS = ["def fibonacci(n):", "import os\n\nclass Config:", "for i in range(10):", "    def __init__(self, name):",
           "# Parse the arguments\nparser = argparse.", "with open(path) as f:"]


def make_pair(out: Path, vocab: int = 2048, hidden: int = 512, layers: int = 8) -> tuple[Path, Path]:
    target_dir, draft_dir = out / "target", out / "draft"
    if (draft_dir / "config.json").exists():
        return target_dir, draft_dir
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:60]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train([str(p) for p in stdlib], trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1024, tie_word_embeddings=False)
    target = LlamaForCausalLM(config)
    with torch.no_grad():
        target.lm_head.weight.mul_(20)  # peaked next-token distributions, like a trained model's
        for layer in target.model.layers[1:]:  # deeper layers as small corrections to layer 0's guess
            layer.self_attn.o_proj.weight.mul_(DEPTH_SCALE)
            layer.mlp.down_proj.weight.mul_(DEPTH_SCALE)
    draft_config = LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 1})
    draft = LlamaForCausalLM(draft_config)
    draft.load_state_dict(target.state_dict(), strict=False)  # layer 0, embeddings, norm, head
    for model, directory in ((target, target_dir), (draft, draft_dir)):
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    return target_dir, draft_dir


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="/tmp/specdec-quick-pair")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    target_dir, draft_dir = make_pair(Path(args.out))
    target = specdec.load_model(target_dir, device="cpu")
    draft = specdec.ModelDrafter(specdec.load_model(draft_dir, device="cpu"))
    strategies = {"plain": specdec.SpeculativeDecoder(target)}
    for gamma in (2, 4, 6, "auto"):
        strategies[f"chain γ={gamma}"] = specdec.SpeculativeDecoder(target, draft, gamma=gamma)
    strategies["prompt lookup γ=4"] = specdec.SpeculativeDecoder(target, specdec.PromptLookupDrafter(), gamma=4)
    for mode, temperature in (("greedy", 0.0), ("sampled T=1", 1.0)):
        runs = {name: [] for name in strategies}
        for decoder in strategies.values():  # warm-up
            decoder.generate(PROMPTS[0], max_new_tokens=8, temperature=temperature, seed=0)
        for round_ in range(args.rounds):
            for i, prompt in enumerate(PROMPTS):
                texts = set()
                for name, decoder in strategies.items():
                    result = decoder.generate(prompt, max_new_tokens=args.new, temperature=temperature, seed=1000 * round_ + i)
                    runs[name].append(result.stats)
                    texts.add(result.text)
                assert temperature or len(texts) == 1, "greedy texts differ between strategies"
        report(mode, runs)


def report(mode: str, runs: dict) -> None:
    plain = statistics.median(s.tokens_per_second for s in runs["plain"])
    print(f"\n### {mode}: {len(runs['plain'])} generations per strategy, {torch.get_num_threads()} threads\n")
    print("| strategy | tokens/s (median) | speedup vs plain | acceptance | tokens per target forward | draft forwards per token |")
    print("|---|---|---|---|---|---|")
    for name, stats in runs.items():
        tps = statistics.median(s.tokens_per_second for s in stats)
        drafted = sum(s.drafted for s in stats)
        acceptance = f"{sum(s.accepted for s in stats) / drafted:.3f}" if drafted else "–"
        tokens = sum(s.generated_tokens for s in stats)
        tau = tokens / sum(s.target_forwards for s in stats)
        draft_fw = sum(s.draft_forwards for s in stats) / tokens
        print(f"| {name} | {tps:.1f} | {tps / plain:.2f}× | {acceptance} | {tau:.2f} | {draft_fw:.2f} |")


if __name__ == "__main__":
    main()
