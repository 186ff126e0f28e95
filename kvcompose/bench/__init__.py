"""Benchmarks: fidelity to the full cache (teacher-forced traces) and decoding speed.

- `kvcompose.bench.fidelity`: reference traces, teacher forcing through any cache, metrics.
- `kvcompose.bench.speed`: decode throughput and time spent in compression events.
- `kvcompose.bench.report`: JSON / Markdown / PNG output.
- `kvcompose.bench.kvpress`: the side-by-side with NVIDIA kvpress (run in its own virtualenv).

The command line is `kvcompose bench fidelity|speed ...` (see `kvcompose.cli`).
"""

from .fidelity import (
    FidelityResult,
    FreeGenResult,
    Trace,
    TraceScore,
    evaluate,
    extract_answer,
    free_generation,
    kl_divergence,
    load_questions,
    make_traces,
    perplexity_ratio,
    top1_agreement,
)

__all__ = [
    "Trace", "TraceScore", "FidelityResult", "FreeGenResult", "load_questions", "make_traces", "evaluate",
    "free_generation", "extract_answer", "kl_divergence", "top1_agreement", "perplexity_ratio",
]
