"""Summaries and reports of `kvcompose bench speed`: tokens/s in windows and in the steady state
(`summarize`), ratios to the ideal and the full cache of the same process (`with_ratios`), the Markdown
report (`speed_markdown`) and the plot (`plot_speed`)."""

from __future__ import annotations

import math
import statistics
from typing import Any

from ..view import KVComposeError
from .decode import DecodeTrace
from .speed_kvpress import KVPRESS_ANALOGUE

__all__ = ["summarize", "with_ratios", "speed_markdown", "plot_speed"]


def summarize(step_seconds: list[float], first_seen: int, *, batch: int = 1, window: int = 128,
              steady_fraction: float = 0.5) -> dict[str, Any]:
    """Tokens/s of a run of decode steps: overall, per window of `window` steps (labelled by tokens seen at
    the window's end), and in the steady state (the last `steady_fraction` of the steps).

    Rates are total tokens over total time (`batch` tokens per step), so compression events count."""
    if window < 1 or not 0 < steady_fraction <= 1:
        raise KVComposeError(f"bad window {window} or steady_fraction {steady_fraction}")
    n = len(step_seconds)
    if n == 0:
        return {"steps": 0, "decode_seconds": 0.0, "tokens_per_s": math.nan, "steady_tokens_per_s": math.nan,
                "steady_from_seen": None, "steady_median_step_ms": math.nan, "windows": []}
    windows = []
    for s in range(0, n, window):
        chunk = step_seconds[s : s + window]
        if len(chunk) < max(1, window // 2) and windows:  # a short tail: fold it out
            break
        windows.append({"seen": first_seen + s + len(chunk), "tokens_per_s": batch * len(chunk) / sum(chunk)})
    s0 = min(n - 1, int(round(n * (1 - steady_fraction))))
    steady = step_seconds[s0:]
    return {
        "steps": n,
        "decode_seconds": sum(step_seconds),
        "tokens_per_s": batch * n / sum(step_seconds),
        "steady_from_seen": first_seen + s0,
        "steady_tokens_per_s": batch * len(steady) / sum(steady),
        "steady_median_step_ms": 1e3 * statistics.median(steady),
        "windows": windows,
    }


def _row(tr: DecodeTrace | dict[str, Any], window: int, steady_fraction: float, engine: str) -> dict[str, Any]:
    d = tr.to_dict() if isinstance(tr, DecodeTrace) else dict(tr)
    steps = d.pop("step_seconds", []) or []
    s = summarize(steps, d.get("first_seen", 0), batch=d.get("batch", 1), window=window,
                  steady_fraction=steady_fraction) if steps else summarize([], 0)
    d.update(s)
    d["engine"] = engine
    d["compress_share"] = d.get("compress_seconds", 0.0) / s["decode_seconds"] if s["decode_seconds"] else math.nan
    held = [h for seen, h in d.get("held", []) if s["steady_from_seen"] is not None and seen >= s["steady_from_seen"]]
    d["steady_held_max"] = max(held) if held else None
    d["steady_held_min"] = min(held) if held else None
    return d


def with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add `vs_ideal` / `vs_full` (steady tokens/s over the ideal's / the full cache's) to rows of one process
    (one engine), and the per-window ratio to the full cache (`windows[i]["vs_full"]`)."""
    by_kind = {r["kind"]: r for r in rows if r.get("kind") in ("ideal", "full") and not r.get("error")}
    ideal, full = by_kind.get("ideal"), by_kind.get("full")
    for r in rows:
        r["vs_ideal"] = r["steady_tokens_per_s"] / ideal["steady_tokens_per_s"] if ideal else math.nan
        r["vs_full"] = r["steady_tokens_per_s"] / full["steady_tokens_per_s"] if full else math.nan
        r["kv_vs_full"] = r["peak_kv_bytes"] / full["peak_kv_bytes"] if full and full["peak_kv_bytes"] else math.nan
        if full:
            fw = {w["seen"]: w["tokens_per_s"] for w in full["windows"]}
            for w in r["windows"]:
                w["vs_full"] = w["tokens_per_s"] / fw[w["seen"]] if w["seen"] in fw else math.nan
            st = [w["vs_full"] for w in r["windows"] if r["steady_from_seen"] is not None
                  and w["seen"] > r["steady_from_seen"] and w["vs_full"] == w["vs_full"]]
            r["vs_full_window_min"] = min(st) if st else math.nan
            r["vs_full_window_max"] = max(st) if st else math.nan
    return rows


# ------------------------------------------------------------------------------------------ report
def _f(x: Any, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return "-"
    if isinstance(x, (int,)) and not isinstance(x, bool):
        return str(x)
    return f"{x:.{digits}f}"


def speed_markdown(data: dict[str, Any]) -> str:
    """The Markdown report of a `speed.json`."""
    cfg = data.get("config", {})
    lines = [
        f"# Decode speed against tokens seen: {cfg.get('model')}",
        "",
        f"{cfg.get('new_tokens')} greedy tokens after a {cfg.get('prompt_tokens')}-token prompt, budget "
        f"{cfg.get('budget')}, {cfg.get('threads')} thread(s), device {cfg.get('device')}. "
        f"Steady state = the last {cfg.get('steady_fraction', 0.5):.0%} of the steps.",
        "",
        "| row | held (steady) | peak KV MiB | tok/s overall | tok/s steady | vs ideal | vs full | events share "
        "| events | kvpress analogue: vs its ideal / its full | kvcompose / kvpress |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data.get("rows", []):
        if r.get("error") and not r.get("steps"):
            lines.append(f"| {r['name']} | error: {r['error']} |||||||||")
            continue
        held = "-" if r.get("steady_held_min") is None else (
            f"{r['steady_held_min']}" if r["steady_held_min"] == r["steady_held_max"]
            else f"{r['steady_held_min']}-{r['steady_held_max']}")
        kp = "-" if "kvpress_vs_full" not in r else \
            f"{_f(r.get('kvpress_vs_ideal'))} / {_f(r['kvpress_vs_full'])} ({r['kvpress_press']})"
        share = "-" if r["kind"] != "kvcompose" or r.get("method") == "full" else f"{100 * r['compress_share']:.1f}%"
        lines.append(
            f"| {r['name']} | {held} | {_f(r['peak_kv_bytes'] / 2**20)} | {_f(r['tokens_per_s'], 1)} | "
            f"{_f(r['steady_tokens_per_s'], 1)} | {_f(r.get('vs_ideal'))} | {_f(r.get('vs_full'))} | {share} | "
            f"{r.get('compress_calls', 0) if r['kind'] == 'kvcompose' else '-'} | {kp} | {_f(r.get('vs_kvpress'))} |")
    kp = data.get("kvpress")
    if kp:
        v = kp.get("versions") or {}
        lines += ["", f"kvpress's own process (kvpress {v.get('kvpress', '?')}, transformers {v.get('transformers', '?')}):",
                  "", "| row | held (steady) | peak KV MiB | tok/s steady | vs its ideal | vs its full |", "|---|---|---|---|---|---|"]
        for r in kp["rows"]:
            if r.get("error") and not r.get("steps"):
                lines.append(f"| {r['name']} | error: {r['error']} |||||")
                continue
            held = "-" if r.get("steady_held_min") is None else f"{r['steady_held_min']}-{r['steady_held_max']}"
            lines.append(f"| {r['name']} | {held} | {_f(r['peak_kv_bytes'] / 2**20)} | {_f(r['steady_tokens_per_s'], 1)} "
                         f"| {_f(r.get('vs_ideal'))} | {_f(r.get('vs_full'))} |")
        lines += ["", f"kvpress command: `{kp.get('command')}`"]
    for name, e in (data.get("errors") or {}).items():
        lines.append(f"\n- {name} could not run: {e}")
    lines += [""] + [f"- {n}" for n in data.get("notes", [])]
    load = [v for _, v in data.get("loadavg_1min", [])]
    if load:
        lines.append(f"- Load average (1 min) during the run: median {statistics.median(load):.1f}, max {max(load):.1f} "
                     f"on {cfg.get('cpus', '?')} cores.")
    if cfg.get("command"):
        lines += ["", f"Command: `{cfg['command']}`"]
    return "\n".join(lines) + "\n"


def plot_speed(data: dict[str, Any], path) -> None:
    """Tokens/s against tokens seen (left) and the ratio to the full cache of the same process (right); a
    kvpress row is drawn dashed in the colour of its kvcompose analogue."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    cmap = plt.get_cmap("tab10")
    base = {"ideal": dict(color="black", ls=":", lw=2), "full": dict(color="grey", ls="--", lw=2)}
    colors: dict[str, Any] = {}
    rows = [r for r in data.get("rows", []) if r.get("windows")]
    for r in rows:
        if r["kind"] in base:
            style = base[r["kind"]]
        else:
            colors[r.get("method") or r["name"]] = cmap(len(colors) % 10)
            style = dict(color=colors[r.get("method") or r["name"]], lw=1.4)
        xs = [w["seen"] for w in r["windows"]]
        axes[0].plot(xs, [w["tokens_per_s"] for w in r["windows"]], label=r["name"], **style)
        axes[1].plot(xs, [w.get("vs_full", math.nan) for w in r["windows"]], label=r["name"], **style)
    back = {v: k for k, v in KVPRESS_ANALOGUE.items()}
    kp = (data.get("kvpress") or {}).get("rows", [])
    for r in [r for r in kp if r.get("windows") and r["kind"] != "full"]:
        if r["kind"] == "ideal":
            style = dict(color="black", ls=(0, (1, 3)), lw=1)
        else:
            c = colors.get(back.get(r.get("method") or ""), None)
            style = dict(color=c if c is not None else cmap((len(colors) + 1) % 10), ls="--", lw=1.2)
        axes[1].plot([w["seen"] for w in r["windows"]], [w.get("vs_full", math.nan) for w in r["windows"]],
                     label=f"kvpress: {r['name']}", **style)
    axes[0].set(xlabel="tokens seen", ylabel="tokens/s (window)", title="decode speed (one process, interleaved)")
    axes[1].set(xlabel="tokens seen", ylabel="speed / full cache of the same process",
                title="ratio to the full cache (kvpress dashed: to its own)")
    axes[1].axhline(1.0, color="grey", lw=0.8)
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
