"""What a seeded request's draws cost the draft model's acceptance (issue 30), on the demo pair
(transformers): per generated position of sampled continuations of suite prompts, the chance that
a one-token model draft is kept under
- rejection sampling of a token drawn from q (unseeded requests): sum min(p, q);
- a point mass at argmax q: p(argmax q);
- the Gumbel coupling (seeded requests under the default drafter): the draft argmax(q / E), the
  target's token argmax(p / E), the same noise E ~ Exp(1): P(they agree), estimated over 2,000 draws
  of E per position.
No clock: the figures are properties of the two models' distributions.

    python benchmarks/seeded_coupling.py 0.7      # the temperature; prints one line per suite
"""

from __future__ import annotations

import itertools
import statistics
import sys

import torch

import specdec
from specdec.bench.suites import suite_tasks
from specdec.sampling import probs_from_logits
from specdec.params import SamplingParams


def main() -> None:
    temperature = float(sys.argv[1]) if len(sys.argv) > 1 else 0.7
    decoder = specdec.load(None, threads=2, backend="transformers", prefix_cache=0)
    target, draft, params = decoder.target, decoder.draft_model, SamplingParams(temperature=temperature)
    generator = torch.Generator().manual_seed(0)
    for suite in ("complete", "prose", "edit"):
        rejection, point_mass, coupled = [], [], []
        for i, task in enumerate(itertools.islice(suite_tasks(suite), 4)):
            prompt = decoder.prompt_ids(task.prompt_for(decoder.tokenizer))
            out = decoder.generate(prompt, max_new_tokens=64, temperature=temperature, seed=100 + i)
            ids, n = prompt + out.tokens, len(out.tokens)
            p, q = (probs_from_logits(model_distribution(model, ids[:-1], n), params) for model in (target, draft))
            rejection += torch.minimum(p, q).sum(-1).tolist()
            point_mass += p.gather(1, q.argmax(-1, keepdim=True)).squeeze(1).tolist()
            for row in range(n):
                noise = torch.empty(2000, p.shape[1], dtype=torch.float64).exponential_(generator=generator)
                coupled.append(float(((p[row] / noise).argmax(-1) == (q[row] / noise).argmax(-1)).double().mean()))
        print(f"T {temperature} {suite}: rejection sampling {statistics.mean(rejection):.3f}, point mass at argmax q "
              f"{statistics.mean(point_mass):.3f}, Gumbel coupling {statistics.mean(coupled):.3f} ({len(rejection)} positions)")


def model_distribution(model, ids: list[int], last: int) -> torch.Tensor:
    """The model's logits at the last `last` positions of `ids`, each scoring the token after it
    (with ids = prompt + output[:-1]: those the output's tokens were drawn from)."""
    sequence = model.sequence()
    try:
        return sequence.forward(ids, last=last).double()
    finally:
        sequence.release()


if __name__ == "__main__":
    main()
