"""Render benchmark JSON as Markdown tables and PNG plots (matplotlib, Agg backend).

`fidelity.json` rows: `{"engine", "method", "budget", "kind", "top1", "kl_mean", "ppl_ratio", "max_held_tokens",
"max_kv_bytes", "kv_ratio", "recall_delta", "kl_curve", "kl_curve_bucket", "n_traces", "n_tokens"}`; the
kvcompose engine is `"kvcompose"`, kvpress rows carry `"kvpress <version> / transformers <version>"`.
`speed.json` rows: `SpeedResult` dicts plus the ratios to the full cache.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

__all__ = ["ci", "slug", "fidelity_markdown", "speed_markdown", "plot_fidelity", "plot_kl_curves", "plot_speed", "fmt"]


def fmt(x: Any, digits: int = 3) -> str:
    """Format a number for a table (`-` for None/NaN)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float):
        if x != 0 and abs(x) < 10 ** (-digits):
            return f"{x:.1e}"
        return f"{x:.{digits}f}"
    return str(x)


def ci(row: dict[str, Any], key: str, digits: int = 4) -> str:
    """` [lo, hi]` of a row's bootstrap interval `key` (e.g. "kl_ci"), or "" when the row has none."""
    v = row.get(key)
    if not v or len(v) != 2:
        return ""
    return f" [{fmt(v[0], digits)}, {fmt(v[1], digits)}]"


def slug(text: str) -> str:
    """A file-name-safe form of a trace-kind label."""
    import re

    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_").lower()


def _kinds(rows: list[dict]) -> list[str]:
    order = ["sampled", "worked", "greedy"]
    kinds = {r["kind"] for r in rows}
    return [k for k in order if k in kinds] + sorted(kinds - set(order))


def _methods(rows: list[dict]) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []
    for r in rows:
        k = (r["engine"], r["method"])
        if k not in seen:
            seen.append(k)
    return seen


def _colors(rows: list[dict], plt) -> dict[str, Any]:
    """One color per method name, shared by kvcompose and kvpress rows of the same method."""
    names: list[str] = []
    for r in rows:
        if r["method"] not in names:
            names.append(r["method"])
    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    return {n: cmap(i % cmap.N) for i, n in enumerate(names)}


def _style(engine: str, method: str, colors: dict) -> dict[str, Any]:
    if engine == "kvcompose":
        return dict(color=colors[method], marker="o", linestyle="-", label=method)
    return dict(color=colors[method], marker="s", markerfacecolor="none", markersize=8, linestyle="--",
                label=f"{method} (kvpress)")


def _title(kind: str) -> str:
    return kind if kind.endswith("tokens") else f"{kind} traces"


def _label(engine: str, method: str) -> str:
    return method if engine == "kvcompose" else f"{method} (kvpress)"


def _interval_text(cfg: dict[str, Any], rows: list[dict]) -> str:
    """'compression interval 64', or each preset's own interval when the run did not set one."""
    if "interval" in cfg and cfg["interval"] is not None:
        return f"compression interval {cfg['interval']}"
    if "interval" not in cfg:
        return "compression interval ?"
    own: dict[int, list[str]] = {}
    for r in rows:
        if r.get("engine") == "kvcompose" and r.get("interval") and r["method"] not in own.get(r["interval"], []):
            own.setdefault(r["interval"], []).append(r["method"])
    parts = "; ".join(f"{i}: {', '.join(ms)}" for i, ms in sorted(own.items()))
    return f"each preset's own compression interval ({parts})" if parts else "each preset's own compression interval"


def fidelity_markdown(data: dict[str, Any]) -> str:
    """Tables of a fidelity run: per trace kind a method x budget table of top-1 / KL, then all metrics."""
    rows = [r for r in data["rows"] if "error" not in r]
    out: list[str] = []
    cfg = data.get("config", {})
    out.append(f"Model `{cfg.get('model', '?')}`, {cfg.get('n_prompts', '?')} GSM8K prompts "
               f"(offset {cfg.get('offset', 0)}), {cfg.get('new_tokens', '?')} trace tokens each, "
               f"{_interval_text(cfg, rows)}, dtype {cfg.get('dtype', '?')}.")
    if data.get("prompt_lengths"):
        pl = data["prompt_lengths"]
        out.append(f"Prompt lengths (chat template): {min(pl)}-{max(pl)} tokens.")
    out.append("")
    kinds = _kinds(rows)
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
    for kind in kinds:
        kr = [r for r in rows if r["kind"] == kind]
        out.append(f"### {_title(kind)}: top-1 agreement / mean KL(full || method) in nats"
                   + (" [95% bootstrap interval over prompts]" if any("kl_ci" in r for r in kr) else ""))
        out.append("")
        out.append("| method | " + " | ".join(f"B={b}" for b in budgets) + " |")
        out.append("|---|" + "---|" * len(budgets))
        for eng, m in _methods(kr):
            cells = []
            for b in budgets:
                r = next((x for x in kr if x["engine"] == eng and x["method"] == m and x["budget"] == b), None)
                if r is None and m == "full":
                    r = next((x for x in kr if x["engine"] == eng and x["method"] == m), None)
                cells.append("-" if r is None else f"{fmt(r['top1'])} / {fmt(r['kl_mean'], 4)}{ci(r, 'kl_ci', 4)}")
            out.append(f"| {_label(eng, m)} | " + " | ".join(cells) + " |")
        out.append("")
    out.append("### All metrics")
    out.append("")
    out.append("| engine | method | budget | trace | prompts | top-1 | KL (nats) | ppl ratio | max held | peak KV MiB | KV / full | recall Δ logprob |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        kv = r.get("max_kv_bytes")
        out.append(
            f"| {r['engine']} | {r['method']} | {fmt(r['budget'])} | {r['kind']} | {fmt(r.get('n_traces'))} | "
            f"{fmt(r['top1'])}{ci(r, 'top1_ci', 3)} | "
            f"{fmt(r['kl_mean'], 4)}{ci(r, 'kl_ci', 4)} | {fmt(r['ppl_ratio'])} | {fmt(r.get('max_held_tokens'))} | "
            f"{fmt(kv / 2**20, 2) if kv else '-'} | {fmt(r.get('kv_ratio'))} | {fmt(r.get('recall_delta'))} |"
        )
    errs = [r for r in data["rows"] if "error" in r]
    if errs:
        out.append("")
        out.append("Failed runs: " + "; ".join(f"{r['engine']} {r['method']}@{r['budget']}: {r['error']}" for r in errs))
    if data.get("free_generation"):
        out.append("")
        out.append("### Free generation (greedy, end to end)")
        out.append("")
        fg = data["free_generation"]
        full_em = fg[0].get("full_exact_match")
        out.append(f"Full cache exact match vs GSM8K: {fmt(full_em, 2)} ({fg[0].get('n')} questions, "
                   f"at most {data.get('config', {}).get('free_gen_tokens', '?')} new tokens).")
        out.append("")
        out.append("| method | budget | answer agrees with full | identical text | exact match | mean new tokens |")
        out.append("|---|---|---|---|---|---|")
        for r in fg:
            out.append(f"| {r['method']} | {r['budget']} | {fmt(r['answer_agreement'], 2)} | {fmt(r['text_agreement'], 2)} | "
                       f"{fmt(r['exact_match'], 2)} | {fmt(r['mean_new_tokens'], 0)} |")
    for note in data.get("notes", []):
        out.append("")
        out.append(f"> {note}")
    return "\n".join(out) + "\n"


def speed_markdown(data: dict[str, Any]) -> str:
    cfg = data.get("config", {})
    out = [f"Model `{cfg.get('model', '?')}`, {cfg.get('new_tokens', '?')} greedy decoded tokens after a "
           f"{cfg.get('prompt_tokens', '?')}-token prompt, budget {cfg.get('budget', '?')}, interval "
           f"{cfg.get('interval', '?')}, device {cfg.get('device', '?')}, {cfg.get('threads', '?')} threads.", ""]
    out.append("| method | tokens/s | vs full | compression share of decode time | compression calls | peak KV MiB | peak KV vs full |")
    out.append("|---|---|---|---|---|---|---|")
    for r in data["rows"]:
        out.append(f"| {r['name']} | {fmt(r['tokens_per_s'], 1)} | {fmt(r.get('speed_ratio'), 2)} | "
                   f"{fmt(r['compress_share'] * 100, 1) + ' %' if r['compress_share'] == r['compress_share'] else '-'} | "
                   f"{r['compress_calls']} | {fmt(r['peak_kv_bytes'] / 2**20, 2)} | {fmt(r.get('kv_ratio'), 3)} |")
    for note in data.get("notes", []):
        out.append("")
        out.append(f"> {note}")
    return "\n".join(out) + "\n"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_fidelity(data: dict[str, Any], path: str | Path) -> None:
    """Mean KL (log scale) and top-1 agreement vs budget, one panel column per trace kind."""
    plt = _plt()
    rows = [r for r in data["rows"] if "error" not in r and r["budget"] is not None]
    kinds = _kinds(rows)
    if not kinds:
        return
    fig, axes = plt.subplots(2, len(kinds), figsize=(5.5 * len(kinds), 8), squeeze=False)
    methods = _methods(rows)
    colors = _colors(rows, plt)
    for j, kind in enumerate(kinds):
        for eng, m in methods:
            rs = sorted((r for r in rows if r["kind"] == kind and r["engine"] == eng and r["method"] == m),
                        key=lambda r: r["budget"])
            if not rs:
                continue
            style = _style(eng, m, colors)
            axes[0, j].plot([r["budget"] for r in rs], [max(r["kl_mean"], 1e-5) for r in rs], **style)
            axes[1, j].plot([r["budget"] for r in rs], [r["top1"] for r in rs], **style)
        for ax in axes[:, j]:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("budget (tokens per layer and KV head)")
            ax.grid(alpha=0.3)
        axes[0, j].set_yscale("log")
        axes[0, j].set_ylabel("mean KL(full || method), nats")
        axes[1, j].set_ylabel("top-1 agreement with the full cache")
        axes[0, j].set_title(_title(kind))
    for j in range(len(kinds)):
        axes[0, j].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_kl_curves(data: dict[str, Any], path: str | Path, kind: str = "sampled") -> None:
    """KL along the trace (mean per position bucket), one panel per budget."""
    plt = _plt()
    rows = [r for r in data["rows"] if "error" not in r and r["budget"] is not None and r["kind"] == kind
            and r.get("kl_curve")]
    budgets = sorted({r["budget"] for r in rows})
    if not budgets:
        return
    fig, axes = plt.subplots(1, len(budgets), figsize=(4.5 * len(budgets), 3.8), squeeze=False)
    methods = _methods(rows)
    colors = _colors(rows, plt)
    for j, b in enumerate(budgets):
        ax = axes[0, j]
        for eng, m in methods:
            r = next((x for x in rows if x["budget"] == b and x["engine"] == eng and x["method"] == m), None)
            if r is None:
                continue
            bucket = r.get("kl_curve_bucket", 64)
            xs = [(k + 0.5) * bucket for k in range(len(r["kl_curve"]))]
            style = _style(eng, m, colors)
            style.pop("marker")
            style.pop("markerfacecolor", None)
            style.pop("markersize", None)
            ax.plot(xs, [max(v, 1e-5) for v in r["kl_curve"]], **style)
        ax.set_yscale("log")
        ax.set_title(f"B={b}, {_title(kind)}", fontsize=9)
        ax.set_xlabel("trace position (tokens)")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("mean KL per bucket, nats")
    axes[0, -1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_speed(data: dict[str, Any], path: str | Path) -> None:
    """Decode tokens/s relative to the full cache, and the share of time in compression events."""
    plt = _plt()
    rows = data["rows"]
    names = [r["name"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.45 * len(rows) + 1.6))
    speed = [r.get("speed_ratio", float("nan")) for r in rows]
    share = [100 * r["compress_share"] if r["compress_share"] == r["compress_share"] else 0.0 for r in rows]
    axes[0].barh(names, speed, color="tab:blue")
    axes[0].axvline(1.0, color="k", lw=0.8)
    axes[0].set_xlabel("decode tokens/s relative to the full cache")
    axes[1].barh(names, share, color="tab:orange")
    axes[1].set_xlabel("time in compression events, % of decode time")
    for ax, vals, f in ((axes[0], speed, "{:.2f}"), (axes[1], share, "{:.1f}")):
        for i, v in enumerate(vals):
            ax.text(v, i, " " + f.format(v), va="center", fontsize=8)
        ax.invert_yaxis()
        ax.grid(alpha=0.3, axis="x")
        ax.set_xlim(0, max([v for v in vals if v == v] + [1e-9]) * 1.18)
    axes[1].set_yticklabels([])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
