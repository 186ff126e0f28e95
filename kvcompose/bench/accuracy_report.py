"""Markdown table and plots of `kvcompose bench accuracy` (from `accuracy.json`), in the papers' form:
accuracy against KV budget (one line per method, the full cache as a horizontal line) and accuracy against
peak KV bytes per request."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .report import fmt

__all__ = ["accuracy_markdown", "plot_accuracy_vs_budget", "plot_accuracy_vs_kv", "render"]

MIB = 2**20


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def accuracy_markdown(data: dict[str, Any]) -> str:
    """The results table (accuracy in %, with its 95% interval) and the run's settings."""
    cfg = data["config"]
    rows = data["rows"]
    n_items = max((r["n_items"] for r in rows), default=0)
    lines = [
        f"Model `{cfg.get('model') or 'SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)'}`, {n_items} questions from "
        f"{data['source']}, {cfg['samples']} sample(s) per question, "
        + ("greedy decoding" if not cfg["temperature"] else f"temperature {cfg['temperature']}, top-p {cfg['top_p']}")
        + f", at most {cfg['max_new_tokens']} new tokens, batch size {cfg['batch_size']}"
        + (f", compression interval {cfg['interval']}" if cfg.get("interval") else ", each preset's default interval")
        + f", {data['n_records']} generations, {data['n_new_tokens']} generated tokens"
        + f", {data.get('threads', '?')} torch threads, {data['elapsed_s']:.0f} s.",
        "",
        "| method | budget | accuracy % (95% CI) | agreement with full % | mean new tokens | ended at EOS % "
        "| peak KV / request MiB | KV vs full | tokens/s | n |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['budget'] if r['budget'] is not None else '-'} | "
            f"{_pct(r['accuracy'])} ({_pct(r['ci_low'])}-{_pct(r['ci_high'])}) | {_pct(r['agreement'])} | "
            f"{r['mean_new_tokens']:.0f} | {_pct(r['eos_share'])} | {r['peak_kv_bytes'] / MIB:.2f} | "
            f"{fmt(r['kv_vs_full'])} | {fmt(r['tokens_per_s'], 1)} | {r['n']} |"
        )
    if data.get("command"):
        lines += ["", f"Command: `{data['command']}`"]
    lines += [""] + [f"> {n}" for n in data.get("notes", [])]
    return "\n".join(lines) + "\n"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _by_method(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        if r["method"] != "full":
            out.setdefault(r["method"], []).append(r)
    return {m: sorted(rs, key=lambda r: r["budget"]) for m, rs in out.items()}


def _full_line(ax, full: dict | None, horizontal: bool = True) -> None:
    if full is None:
        return
    ax.axhline(100 * full["accuracy"], color="black", ls="--", lw=1.2, label="full cache")
    ax.axhspan(100 * full["ci_low"], 100 * full["ci_high"], color="black", alpha=0.07, lw=0)


def plot_accuracy_vs_budget(data: dict[str, Any], path: str | Path) -> None:
    """Accuracy (%) against the KV budget (tokens per layer and head, log scale): one line per method with
    its 95% interval as error bars (methods drawn slightly apart at each budget), the full cache as a dashed
    horizontal line with its interval shaded."""
    plt = _plt()
    rows = data["rows"]
    full = next((r for r in rows if r["method"] == "full"), None)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    _full_line(ax, full)
    groups = _by_method(rows)
    for i, (m, rs) in enumerate(groups.items()):
        dodge = 2 ** (0.04 * (i - (len(groups) - 1) / 2))  # methods side by side at each budget (log axis)
        xs = [r["budget"] * dodge for r in rs]
        ys = [100 * r["accuracy"] for r in rs]
        err = [[100 * (r["accuracy"] - r["ci_low"]) for r in rs], [100 * (r["ci_high"] - r["accuracy"]) for r in rs]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=m)
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
    if budgets:
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("KV budget (tokens per layer and KV head)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(_title(data))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_accuracy_vs_kv(data: dict[str, Any], path: str | Path) -> None:
    """Accuracy (%) against peak KV MiB per request: one line per method through its budgets, the full cache
    as a star (and a dashed line at its accuracy)."""
    plt = _plt()
    rows = data["rows"]
    full = next((r for r in rows if r["method"] == "full"), None)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    _full_line(ax, full)
    if full is not None:
        ax.plot([full["peak_kv_bytes"] / MIB], [100 * full["accuracy"]], "k*", ms=12)
    for m, rs in _by_method(rows).items():
        ax.plot([r["peak_kv_bytes"] / MIB for r in rs], [100 * r["accuracy"] for r in rs], marker="o", label=m)
        for r in rs:
            ax.annotate(str(r["budget"]), (r["peak_kv_bytes"] / MIB, 100 * r["accuracy"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("peak KV per request (MiB)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(_title(data))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _title(data: dict[str, Any]) -> str:
    cfg = data["config"]
    n = max((r["n_items"] for r in data["rows"]), default=0)
    model = cfg.get("model") or "SmolLM2-135M-Instruct"
    return f"{Path(str(model)).name}, {n} questions, {cfg['max_new_tokens']} new tokens max"


def render(out: str | Path) -> list[Path]:
    """(Re)write `accuracy.md`, `accuracy_vs_budget.png` and `accuracy_vs_kv.png` from `out/accuracy.json`."""
    out = Path(out)
    data = json.loads((out / "accuracy.json").read_text())
    (out / "accuracy.md").write_text(accuracy_markdown(data))
    plot_accuracy_vs_budget(data, out / "accuracy_vs_budget.png")
    plot_accuracy_vs_kv(data, out / "accuracy_vs_kv.png")
    return [out / "accuracy.md", out / "accuracy_vs_budget.png", out / "accuracy_vs_kv.png"]
