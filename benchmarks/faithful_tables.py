"""Random Attention's matched-protection table and VaSE's ablation as fidelity tables (docs/faithful.md).

    python benchmarks/faithful_tables.py --table random_attention --traces runs/faithful/traces/traces.json \
        --budgets 64 128 256 --threads 1 --out runs/faithful
    python benchmarks/faithful_tables.py --table vase --traces runs/faithful/traces/traces.json \
        --budgets 64 128 256 --free-gen-prompts 4 --free-gen-budgets 64 128 --threads 1 --out runs/faithful

Questions come from `--data` or $KVCOMPOSE_GSM8K. The rows, the protocol and the metrics are described in
`kvcompose.bench.faithful`.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvcompose.bench.faithful import main  # noqa: E402

if __name__ == "__main__":
    main()
