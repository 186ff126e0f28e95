"""Markdown and plots of the speed, step-time and throughput results (`kvcompose bench report`)."""

from __future__ import annotations

import json
from pathlib import Path

from .speed_report import plot_speed, speed_markdown
from .steptime import steptime_markdown
from .throughput import plot_throughput, throughput_markdown

__all__ = ["render"]


def render(out) -> list[Path]:
    """(Re)write the Markdown and PNG files of the speed, step-time and throughput JSON files in `out`."""
    out = Path(out)
    written: list[Path] = []
    if (out / "speed.json").exists():
        data = json.loads((out / "speed.json").read_text())
        if all("windows" in r for r in data.get("rows", [])):  # not a speed.json of the old format
            (out / "speed.md").write_text(speed_markdown(data))
            plot_speed(data, out / "speed.png")
            written += [out / "speed.md", out / "speed.png"]
    if (out / "steptime.json").exists():
        (out / "steptime.md").write_text(steptime_markdown(json.loads((out / "steptime.json").read_text())))
        written.append(out / "steptime.md")
    if (out / "throughput.json").exists():
        data = json.loads((out / "throughput.json").read_text())
        (out / "throughput.md").write_text(throughput_markdown(data))
        plot_throughput(data, out / "throughput.png")
        written += [out / "throughput.md", out / "throughput.png"]
    return written
