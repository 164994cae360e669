#!/usr/bin/env bash
# How specdec/demo_pair was made: a target, a distilled draft and a Katz trigram, all trained on the
# CPython standard library that ships with the interpreter (every 50th file held out), on 2 CPU cores.
# Training state lives in runs/ (ignored by git); re-running a step resumes it.
set -euo pipefail
cd "$(dirname "$0")/.."
STDLIB=$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
mkdir -p runs
find "$STDLIB" -name '*.py' -not -path "$STDLIB/site-packages/*" | sort > runs/stdlib_files.txt

# 1. target: byte-level BPE (8192) + Llama, 6 layers x 512, ~23.5M parameters
python -m specdec train $(cat runs/stdlib_files.txt) -o runs/target --vocab-size 8192 --hidden-size 512 --layers 6 \
  --heads 8 --intermediate-size 1408 --context 1024 --seq-len 256 --batch-size 16 --steps 1600 --lr 1e-3 --warmup 60 \
  --eval-every 100 --save-every 50 --bf16

# 2. draft: 2 layers x 192 (~2.45M parameters, < 1/8 of the target), distilled from the target (KL on its full
#    next-token distributions over the training files, with its tokenizer). That objective was `specdec train
#    --distill-from` until specdec.distill replaced it (git show d46fcb2^:specdec/train.py); today the same flag
#    distils from the target's own generations into a pruned vocabulary, and a draft made so ships no tokenizer
#    of its own. The shipped draft was made by the earlier one:
git show d46fcb2^:specdec/train.py > runs/train_full_vocab.py
python - <<'PY'
import sys; sys.path.insert(0, "runs")
from train_full_vocab import TrainConfig, train
files = open("runs/stdlib_files.txt").read().split()
train(TrainConfig(files=files, output="runs/draft", distill_from="runs/target", hidden_size=192, layers=2, heads=4,
                  intermediate_size=512, context=1024, seq_len=256, batch_size=16, steps=800, lr=2e-3, warmup=40,
                  eval_every=100, save_every=50, bf16=True))
PY

# 3. Katz trigram over the target's tokenizer, from every fifth non-test training file; specdec.demo.demo_ngram builds
#    the same one from the same files on first use (the package ships only the checkpoints)
awk 'NR % 50 != 0' runs/stdlib_files.txt | grep -v -E '/(test|tests|idlelib|lib2to3)/' | awk 'NR % 5 == 1' > runs/ngram_files.txt
python -m specdec ngram build $(cat runs/ngram_files.txt) --tokenizer runs/target -o runs/ngram.safetensors

# 4. package: fp16 weights, the shared tokenizer and the training reports
python scripts/package_demo_pair.py runs specdec/demo_pair
