"""The ahead-of-time compile table of docs/kernels.md: every Triton kernel kvcompose launches, through its
wrapper, at every configuration (fp32/bf16/fp16, head dims 64/128/256, decode and prefill shapes, the block
sizes the wrappers pick), compiled for sm_80 and sm_90 on a CPU (`kvcompose.bench.aot`; no GPU needed):
registers per thread, spilled bytes and the shared memory each launch asks for.

    python benchmarks/kernel_aot.py                 # the Markdown table + the rule check (exit 1 on a problem)
    python benchmarks/kernel_aot.py --json runs/aot_full.json

Runs in a pool of 2 processes (several minutes on 2 cores). TRITON_INTERPRET must be unset.
"""

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvcompose.bench.aot import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["--full", "--markdown", *sys.argv[1:]]))
