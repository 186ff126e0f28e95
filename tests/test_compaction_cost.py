"""benchmarks/vllm_compaction_cost.py: the event cost of the vLLM route without vLLM, one request or a group of
requests due at one step (`--group`), and the plan of a decode step."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import vllm_compaction_cost  # noqa: E402


def test_grouped_events_are_timed_per_request():
    rows = vllm_compaction_cost.main(["--presets", "streaming_llm", "random_attention", "--budgets", "64",
                                      "--repeats", "1", "--group", "3", "--batch", "2"])
    events = [r for r in rows if "preset" in r]
    assert [(r["preset"], r["group"], r["budget"]) for r in events] == [("streaming_llm", 3, 64),
                                                                        ("random_attention", 3, 64)]
    assert all(r["ms_per_event"] > 0 and r["held"] == 64 + r["interval"] for r in events)
    assert rows[-1]["plan_requests"] == 2 and rows[-1]["us_per_step"] > 0
