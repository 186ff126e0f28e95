"""benchmarks/decode_walk.py: one ordinary decoded token crosses at most 5 kvcompose files, and calls between
them go one way (docs/architecture.md, "One decoded token, file by file")."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import decode_walk  # noqa: E402


def _cycles(arrows: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Arrows `a -> b` where `b` also reaches `a` (a call back up)."""
    succ: dict[str, set[str]] = {}
    for a, b in arrows:
        succ.setdefault(a, set()).add(b)

    def reaches(src: str, dst: str) -> bool:
        seen, todo = set(), [src]
        while todo:
            f = todo.pop()
            if f == dst:
                return True
            if f not in seen:
                seen.add(f)
                todo.extend(succ.get(f, ()))
        return False

    return [(a, b) for a, b in arrows if reaches(b, a)]


def test_cycles_finds_a_call_back_up():
    assert _cycles([("cache.py", "layer.py"), ("layer.py", "attention.py"), ("attention.py", "layer.py")]) == [
        ("layer.py", "attention.py"), ("attention.py", "layer.py")]
    assert _cycles([("cache.py", "layer.py"), ("cache.py", "attention.py"), ("attention.py", "layer.py")]) == []


def test_an_ordinary_token_crosses_five_files_one_way():
    w = decode_walk.walk("streaming_llm")
    assert sorted(w["files"]) == ["attention.py", "attention_math.py", "cache.py", "layer.py", "stores/dense.py"]
    assert _cycles(w["arrows"]) == []


def test_an_observer_adds_only_its_own_files():
    w = decode_walk.walk("h2o")
    assert set(w["files"]) - {"attention.py", "attention_math.py", "cache.py", "layer.py", "stores/dense.py"} == {
        "path.py", "pipeline.py", "scorers.py"}
    assert _cycles(w["arrows"]) == []
