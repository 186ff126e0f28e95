"""A roofline model of one decode step: bytes and flops per kernel, a predicted step time and its floor.

No GPU has run kvcompose: this is the prediction a GPU run is checked against (`benchmarks/gpu_validate.py`
reports achieved bandwidth next to it). Every count comes from the code's own shapes: the presets'
pipelines (`kvcompose.methods.preset`: their scorers, protectors, allocator, tier, observers, interval),
the stores' layouts (dense `[B, H, T, D]`, or pages of 16 tokens with positions and padding flags), the
kernels' tiles (`kvcompose.kernels`: the paged kernel's KV splits and partial results, the key-redundancy
kernel's row tiles, the window kernel's two passes) and the host tier's transfers (`HostStash`: every held
host token comes back over PCIe at every step, and the whole tier content goes out at every event).

Per kernel: `time = max(bytes / HBM bandwidth, flops / matrix peak)` (a kernel reaches one roof at best);
transfers over PCIe take `bytes / PCIe bandwidth` and overlap the HBM work (the layer-ahead prefetch), so
`predicted = max(sum of HBM kernel times, PCIe time)`. The floor is what no implementation of the same
cache can avoid: the weights and the K/V attention must read, at full HBM bandwidth (and the host-held K/V
over PCIe). Compression events run every `interval` steps per layer; their cost is spread over the interval.
Small per-step host work (kernel launches, Python) is not modelled: at batch 1 it is what separates a
measured step from `predicted` (see docs/gpu.md).

    python -m kvcompose.bench.roofline                  # every preset at 4k/32k seen, budgets 1k/4k
    python -m kvcompose.bench.roofline --kernels snapkv # the per-kernel breakdown of one preset
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Hardware", "ModelShape", "H200", "QWEN3_8B", "Kernel", "Step", "paged_attention_cost", "step_cost",
           "table", "markdown", "PAGE", "SMS"]

PAGE = 16  # PagedStore's default page size
SMS = 132  # H200 streaming multiprocessors (the paged kernel's automatic KV splits)


@dataclass(frozen=True)
class Hardware:
    """Bandwidths in bytes/s, matrix throughput in flop/s."""

    hbm: float = 4.8e12
    matrix: float = 790e12
    pcie: float = 55e9
    name: str = "H200 (4.8 TB/s HBM, 790 TFLOP/s bf16 matrix, PCIe 5 ~55 GB/s)"


@dataclass(frozen=True)
class ModelShape:
    layers: int = 36
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    ffn: int = 12288
    vocab: int = 151936
    elt: int = 2  # bf16
    tied: bool = False
    name: str = "Qwen3-8B"

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @classmethod
    def from_config(cls, cfg: Any, elt: int, name: str = "") -> "ModelShape":
        """The shape of a transformers model config (Llama/Qwen-style attention and gated MLP)."""
        heads = cfg.num_attention_heads
        return cls(layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, heads=heads,
                   kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                   head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                   ffn=cfg.intermediate_size, vocab=cfg.vocab_size, elt=elt,
                   tied=bool(getattr(cfg, "tie_word_embeddings", False)), name=name or type(cfg).__name__)

    def weight_params(self) -> int:
        """Parameters a decode step reads (every matrix, the LM head; not the embedding table, of which
        one row is read)."""
        d, hd = self.hidden, self.head_dim
        attn = d * self.heads * hd * 2 + d * self.kv_heads * hd * 2
        mlp = 3 * d * self.ffn
        norms = 2 * d + 2 * hd  # RMSNorms (Qwen3 also normalises q and k per head)
        return self.layers * (attn + mlp + norms) + d + (0 if self.tied else self.vocab * d)


H200 = Hardware()
QWEN3_8B = ModelShape()


@dataclass
class Kernel:
    """One kernel's traffic per decode step (summed over layers; event kernels divided by the interval)."""

    name: str
    hbm_bytes: float | int = 0.0
    flops: float | int = 0.0
    pcie_bytes: float | int = 0.0
    per: str = "step"  # "step" or "event/interval"

    def seconds(self, hw: Hardware) -> float:
        return max(self.hbm_bytes / hw.hbm, self.flops / hw.matrix)


@dataclass
class Step:
    preset: str
    seen: int
    budget: int
    held: float | int  # tokens per (row, KV head) in HBM, on average over the interval
    host: float | int  # tokens per (row, KV head) in host memory
    interval: int
    kernels: list[Kernel] = field(default_factory=list)
    floor_s: float = 0.0

    def hbm_s(self, hw: Hardware) -> float:
        return sum(k.seconds(hw) for k in self.kernels)

    def pcie_s(self, hw: Hardware) -> float:
        return sum(k.pcie_bytes for k in self.kernels) / hw.pcie

    def predicted_s(self, hw: Hardware) -> float:
        return max(self.hbm_s(hw), self.pcie_s(hw))


# ============================================================================ kernels
def paged_attention_cost(m: ModelShape, batch: int, lengths: Any, q: int = 1, page: int = PAGE,
                         sms: int = SMS) -> tuple[int, float, int]:
    """(HBM bytes, flops, KV splits) of one `paged_decode_attention` launch over `lengths` tokens per
    (row, KV head) (a number: every head holds that many; or a sequence of `batch * kv_heads` lengths): the
    pages' keys and values (whole pages), positions (int64) and padding flags, the page table, the queries
    and the output, and with KV splits the fp32 partials (max, sum, accumulator) written and read back by the
    merge; the splits follow `kvcompose.kernels.paged_attention._auto_splits`."""
    h, d, e, g = m.kv_heads, m.head_dim, m.elt, m.group
    lens = [float(lengths)] * (batch * h) if isinstance(lengths, (int, float)) else [float(x) for x in lengths]
    rows = g * q
    programs = batch * h * math.ceil(rows / 16)
    want = math.ceil(2 * sms / max(1, programs))
    pages = [math.ceil(n / page) for n in lens]
    width = max(pages, default=0) * page  # the page table's columns (M * P), what the split rule sees
    splits = int(max(1, min(want, max(1, width // 256), 64)))
    slots = sum(pages) * page
    kv = slots * (2 * d * e + 8 + 1) + sum(pages) * 8
    io = 2 * batch * m.heads * q * d * e
    partial = 0 if splits == 1 else 2 * splits * batch * h * rows * (d + 2) * 4
    flops = 4.0 * m.group * q * sum(lens) * d
    return kv + io + partial, flops, splits


def _window(m: ModelShape, batch: int, t: float, w: int) -> tuple[float | int, float]:
    """`window_attention_scores`: two passes over the keys (softmax statistics, then probabilities), each
    recomputing the W x T logits of every query head; positions and flags; fp32 partials per key tile."""
    h, d, e = m.kv_heads, m.head_dim, m.elt
    per_pass = batch * h * t * (d * e + 9) + batch * m.heads * w * d * e
    partial = 2 * batch * m.heads * w * math.ceil(t / 64) * 4
    return 2 * per_pass + 2 * partial + batch * h * t * 4, 2 * 2.0 * batch * m.heads * w * t * d


def _redundancy(m: ModelShape, batch: int, t: float) -> tuple[float | int, float]:
    """`key_redundancy`: each 64-row tile streams every key once (bf16 at head dim 128); S = K K^T."""
    h, d, e = m.kv_heads, m.head_dim, m.elt
    tile = 64 if d <= 128 else 32
    return batch * h * (math.ceil(t / tile) * t * d * e + t * 13), 2.0 * batch * h * t * t * d


def _scores(m: ModelShape, batch: int, t: float, n_sorts: int = 2) -> float | int:
    """Selection over `t` candidates: priorities (fp32) and a few stable sorts (fp32 keys, int64 indices)."""
    return batch * m.kv_heads * t * (4 + n_sorts * 2 * 12)


# ============================================================================ a step
def _preset(name: Any) -> Any:
    from .. import methods

    return methods.preset(name) if isinstance(name, str) else name


def step_cost(name: Any, seen: int, budget: int, m: ModelShape = QWEN3_8B, hw: Hardware = H200,
              batch: int = 1, interval: int | None = None) -> Step:
    """The decode step of preset `name` (a name of `kvcompose.methods.PRESETS`, or a `Pipeline`) after `seen`
    tokens at a `budget` per layer (ignored by `full`), `batch` rows; `interval`: the cache's (default: the
    pipeline's own, else the cache default)."""
    from ..cache import DEFAULT_INTERVAL

    pipe = _preset(name)
    name = name if isinstance(name, str) else repr(pipe)
    interval = interval or pipe.interval or DEFAULT_INTERVAL
    h, d, e, L = m.kv_heads, m.head_dim, m.elt, m.layers
    tier = type(pipe.tier).__name__
    alloc = pipe.allocator
    host = 0.0
    if not pipe.compresses:
        held = float(seen)
    elif type(alloc).__name__ == "SeenShare":  # HBM holds a share of the tokens seen, capped by the budget
        held = min(alloc.hbm_ratio * seen, budget)
        host = (seen - held) if tier in ("HostTier", "Hierarchy") else 0.0
        host = host * (1 - pipe.tier.compressed_ratio - pipe.tier.evict_ratio) if tier == "Hierarchy" else host
    else:
        held = min(seen, budget + interval / 2)  # between budget and budget + interval over an interval
        if tier == "HostTier":
            host = max(0.0, seen - held)
    st = Step(name, seen, budget, held, host, interval)
    ks = st.kernels
    weights = m.weight_params() * e
    ks.append(Kernel("weights (GEMV)", weights + m.hidden * e, 2.0 * m.weight_params() * batch))
    kv_row = h * 2 * d * e  # one token of one row, all KV heads, keys and values
    observe = bool(pipe.observers)
    tiered = host > 0
    total = held + host
    if pipe.paged and not observe and not tiered:
        b, f, _ = paged_attention_cost(m, batch, held)
        ks.append(Kernel("paged decode attention", L * b, L * f))
    elif not observe and not tiered:
        ks.append(Kernel("attention (SDPA, dense store)", L * batch * (held * kv_row + 2 * m.heads * d * e),
                         L * 4.0 * batch * m.heads * held * d))
    else:  # a padded view of the path (store + tier tokens) is built, attended, and observed
        ks.append(Kernel("gather the path view (copy)", L * batch * total * (kv_row + 9) * 2))
        ks.append(Kernel("attention (SDPA over the view)", L * batch * total * kv_row,
                         L * 4.0 * batch * m.heads * total * d))
        if observe:  # AccumulatedAttention: the probabilities again in fp32, added to the token state
            ks.append(Kernel("observer: attention probabilities", L * batch * (total * h * d * e
                                                                               + 3 * m.heads * total * 4),
                             L * 2.0 * batch * m.heads * total * d))
    if tiered:
        ks.append(Kernel("host tier: fetch (host -> HBM)", L * batch * host * kv_row, 0.0, L * batch * host * kv_row))
    # ---------------------------------------------------------------- events, spread over the interval
    if pipe.compresses:
        t_ev = held + interval / 2 + host  # candidates of an event: HBM (budget + interval) and tier tokens
        ev: list[Kernel] = []
        for leaf in pipe.leaves:
            kind = type(leaf).__name__
            if kind == "WindowedAttention":
                b, f = _window(m, batch, t_ev, leaf.window)
                ev.append(Kernel(f"window scores (W={leaf.window})", b, f))
            elif kind == "LastQueryAttention":
                b, f = _window(m, batch, t_ev, 1)
                ev.append(Kernel("window scores (W=1)", b, f))
            elif kind == "KeyRedundancy":
                b, f = _redundancy(m, batch, t_ev)
                ev.append(Kernel("key redundancy", b, f))
            elif kind in ("ValueNorm", "ProtectValueNorm"):
                ev.append(Kernel("value magnitude", batch * h * t_ev * (d * e + 4)))
            elif kind == "KeyNorm":
                ev.append(Kernel("key norm (torch, fp32 copy)", batch * h * t_ev * d * (e + 8)))
        if type(alloc).__name__ in ("HeadUtility", "GrowPage"):
            b, f = _window(m, batch, t_ev, alloc.query_window)
            ev.append(Kernel(f"allocator window scores (W={alloc.query_window})", b, f))
        ev.append(Kernel("selection (priorities, sorts)", _scores(m, batch, t_ev)))
        ev.append(Kernel("build the event view" if tiered or pipe.paged else "event view (the store itself)",
                         batch * t_ev * (kv_row + 9) * 2 if (tiered or pipe.paged) else 0.0))
        kept = min(budget, t_ev)
        ev.append(Kernel("compaction (" + ("paged gather/scatter" if pipe.paged else "compact kernel, in place") + ")",
                         batch * kept * (kv_row + 9) * (4 if pipe.paged else 2)))
        if tiered:
            ev.append(Kernel("host tier: store (HBM -> host)", batch * host * (kv_row + 9),
                             0.0, batch * host * kv_row))
        for k in ev:
            k.hbm_bytes *= L / interval
            k.flops *= L / interval
            k.pcie_bytes *= L / interval
            k.per = f"event/{interval}"
        ks.extend(ev)
    st.floor_s = max((weights + L * batch * held * kv_row) / hw.hbm, L * batch * host * kv_row / hw.pcie)
    return st


def table(presets: list[str] | None = None, seens=(4096, 32768), budgets=(1024, 4096), m: ModelShape = QWEN3_8B,
          hw: Hardware = H200, batch: int = 1) -> list[Step]:
    from .. import methods

    names = presets or sorted(methods.PRESETS)
    out = []
    for n in names:
        for s in seens:
            for bud in budgets:
                if n == "full" and bud != budgets[0]:
                    continue
                out.append(step_cost(n, s, bud, m, hw, batch))
    return out


def markdown(steps: list[Step], hw: Hardware = H200, kernels: bool = False) -> str:
    if kernels:
        lines = ["| preset | seen | budget | kernel | per | HBM MB | GFLOP | PCIe MB | us |", "|" + "---|" * 9]
        for s in steps:
            for k in s.kernels:
                lines.append(f"| {s.preset} | {s.seen} | {s.budget} | {k.name} | {k.per} | {k.hbm_bytes / 1e6:.2f} | "
                             f"{k.flops / 1e9:.3f} | {k.pcie_bytes / 1e6:.2f} | "
                             f"{1e6 * max(k.seconds(hw), k.pcie_bytes / hw.pcie):.1f} |")
        return "\n".join(lines) + "\n"
    lines = ["| preset | seen | budget | held (HBM) | host | HBM GB | GFLOP | PCIe MB | HBM ms | PCIe ms | "
             "predicted ms | floor ms | events % |", "|" + "---|" * 13]
    for s in steps:
        hb = sum(k.hbm_bytes for k in s.kernels)
        fl = sum(k.flops for k in s.kernels)
        pc = sum(k.pcie_bytes for k in s.kernels)
        ev = sum(k.seconds(hw) for k in s.kernels if k.per != "step")
        lines.append(f"| {s.preset} | {s.seen} | {s.budget if s.preset != 'full' else '-'} | {s.held:.0f} | "
                     f"{s.host:.0f} | {hb / 1e9:.3f} | {fl / 1e9:.1f} | {pc / 1e6:.1f} | {1e3 * s.hbm_s(hw):.3f} | "
                     f"{1e3 * s.pcie_s(hw):.3f} | {1e3 * s.predicted_s(hw):.3f} | {1e3 * s.floor_s:.3f} | "
                     f"{100 * ev / max(s.hbm_s(hw), 1e-12):.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", default=None, help="print the per-kernel breakdown of these presets (comma list)")
    ap.add_argument("--batch", type=int, default=1)
    a = ap.parse_args(argv)
    print(f"{QWEN3_8B.name}, bf16, batch {a.batch}, one decode step; {H200.name}; weights "
          f"{QWEN3_8B.weight_params() * QWEN3_8B.elt / 1e9:.2f} GB")
    print(markdown(table(batch=a.batch)))
    if a.kernels:
        print(markdown(table(a.kernels.split(","), batch=a.batch), kernels=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
