"""`specdec bench`: specdec's strategies and Hugging Face's generate() on the same models, same run."""

from specdec.bench.runner import BenchConfig, run_bench

__all__ = ["BenchConfig", "run_bench"]
