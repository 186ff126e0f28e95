"""Benchmarks: fidelity to the full cache (teacher-forced traces), accuracy on math benchmarks, decoding speed.

- `kvcompose.data`, `kvcompose.traces` (in the library: calibration reads them too): questions (local JSONL,
  Hugging Face datasets, built-in demo questions) and full-cache reference traces.
- `kvcompose.bench.metrics`: KL, top-1, perplexity ratio.
- `kvcompose.bench.fidelity`: teacher forcing through any cache, free generation (the fidelity runner).
- `kvcompose.bench.grading`: answer grading with math-verify plus GSM8K's `#### n` and a last-number fallback.
- `kvcompose.bench.accuracy`: accuracy vs KV budget with batched generation, resumable JSONL, `accelerate`.
- `kvcompose.bench.speed`: tokens/s against tokens seen vs the ideal cache, the full cache and kvpress.
- `kvcompose.bench.steptime`: one decode step after 1k/4k/16k tokens seen; per-layer overhead.
- `kvcompose.bench.throughput`: the largest batch in a KV memory limit and its tokens/s.
- `kvcompose.bench.report`: JSON / Markdown / PNG output.
- `kvcompose.bench.kvpress`: the side-by-side with NVIDIA kvpress (run in its own virtualenv).

The command line is `kvcompose bench fidelity|accuracy|speed|steptime|throughput ...` (`kvcompose.bench.cli`).
"""

from ..data import DATASETS, load_hf_dataset, load_questions, resolve_questions
from .fidelity import FidelityResult, FreeGenResult, TraceScore, evaluate, free_generation
from .grading import extract_final_answer, grade
from .metrics import extract_answer, gsm8k_answer, kl_divergence, perplexity_ratio, top1_agreement
from ..traces import Trace, make_traces

__all__ = [
    "Trace", "TraceScore", "FidelityResult", "FreeGenResult", "load_questions", "make_traces", "evaluate",
    "free_generation", "extract_answer", "gsm8k_answer", "kl_divergence", "top1_agreement", "perplexity_ratio",
    "DATASETS", "load_hf_dataset", "resolve_questions", "grade", "extract_final_answer",
]
