"""Copy trained checkpoints into specdec/demo_pair with fp16 weights (loaded as float32 on the CPU).

The GGUF files and the n-gram model are not shipped: specdec makes them on first use (MODELS.md)."""

import json
import shutil
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

runs, out = Path(sys.argv[1]), Path(sys.argv[2])
for name in ("target", "draft"):
    src, dst = runs / name, out / name
    dst.mkdir(parents=True, exist_ok=True)
    for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, dst / f)
    report = json.loads((src / "training.json").read_text())
    report["files"] = f"{len(report['files'])} files (the CPython standard library, see MODELS.md)"
    (dst / "training.json").write_text(json.dumps(report, indent=1))
    config = json.loads((src / "config.json").read_text())
    config["dtype"] = "float16"  # what the file holds; specdec still loads it as float32 on the CPU
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    weights = {k: v.half().contiguous() for k, v in load_file(str(src / "model.safetensors")).items()}
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
print(f"wrote {out}: {total / 1e6:.1f} MB")
