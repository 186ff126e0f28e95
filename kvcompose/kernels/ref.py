"""Plain PyTorch references for every kvcompose kernel.

These are the CPU implementation and the test oracle for the Triton kernels.  They do
no input validation (the public wrappers in :mod:`kvcompose.kernels` do); arithmetic is
float32 throughout, whatever the input dtype.

Shape letters: B batch, H kv heads, T tokens, D head dim, K kept tokens,
Hq = H * G query heads, W window queries.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

#: Norm floor used when normalising keys for cosine similarity (``F.normalize`` style).
NORM_EPS = 1e-12


# --------------------------------------------------------------------------- top_last
def top_last(key: Tensor, k: int) -> Tensor:
    """Indices ([..., k]) of the ``k`` largest entries of ``key`` along the last dim, the latest index first
    among equal keys.

    ``torch.topk`` breaks ties in an undefined way that changes with the width of the row and the device, so a
    left-padded row of a batch and the same row alone could keep different tokens of equal score (a repeated
    token has the same value vector); a stable sort of the reversed row does not.
    """
    t = key.shape[-1]
    return (t - 1) - torch.sort(key.flip(-1), dim=-1, descending=True, stable=True).indices[..., :k]


# --------------------------------------------------------------------------- compact
def compact(
    keys: Tensor,
    values: Tensor,
    idx: Tensor,
    out_keys: Optional[Tensor] = None,
    out_values: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """Gather rows ``idx`` ([B,H,K]) of keys/values ([B,H,T,D]) -> [B,H,K,D] each.

    The gather is materialised before it is copied into ``out_*``, so the reference is
    correct for any aliasing; the Triton kernel is not (see ``kvcompose.kernels.compact``).
    """
    ik = idx.long().unsqueeze(-1)
    k = torch.gather(keys, 2, ik.expand(-1, -1, -1, keys.shape[-1]))
    v = torch.gather(values, 2, ik.expand(-1, -1, -1, values.shape[-1]))
    if out_keys is not None:
        out_keys.copy_(k)
        k = out_keys
    if out_values is not None:
        out_values.copy_(v)
        v = out_values
    return k, v


# --------------------------------------------------------------------------- value magnitude
def value_magnitude(values: Tensor, kind: str = "range") -> Tensor:
    """[B,H,T,D] -> float32 [B,H,T]: max-min over D ("range", VaSE) or L2 norm ("l2")."""
    v = values.float()
    if kind == "range":
        return v.amax(-1) - v.amin(-1)
    return torch.sqrt((v * v).sum(-1))


# --------------------------------------------------------------------------- key redundancy
def normalize_keys(keys: Tensor) -> Tensor:
    """float32 keys / max(||keys||_2, NORM_EPS) along D."""
    k = keys.float()
    return k / torch.sqrt((k * k).sum(-1, keepdim=True)).clamp_min(NORM_EPS)


def masked_softmax(r: Tensor, valid: Tensor) -> Tensor:
    """Softmax of ``r`` over the last dim restricted to ``valid``; invalid -> 0; a row
    with no valid entry is all 0."""
    x = r.float().masked_fill(~valid, float("-inf"))
    p = torch.softmax(x, dim=-1)
    return torch.where(valid, p, torch.zeros_like(p))


def key_redundancy(keys: Tensor, valid: Tensor, threshold: float = 0.5, chunk: Optional[int] = None) -> Tensor:
    """R-KV redundancy score, [B,H,T,D] keys + Bool [B,H,T] -> float32 [B,H,T].

    S = kn kn^T (float32 cosine similarity), diagonal and invalid rows/cols zeroed; in
    each row i, among the valid off-diagonal columns j with S[i,j] > threshold the one
    with the largest j is zeroed; r[j] = sum_i S[i,j] / n_valid; softmax of r over valid
    tokens.  Rows are processed ``chunk`` at a time so memory is O(B * H * chunk * T)
    (default: about 2**24 similarities per chunk, at least 64 rows).
    """
    B, H, T, _ = keys.shape
    if chunk is None:
        chunk = min(max(T, 1), max(64, 2**24 // max(1, B * H * T)))
    kn = normalize_keys(keys) * valid.unsqueeze(-1)  # invalid rows/cols of S become 0
    ar = torch.arange(T, device=keys.device)
    col = torch.zeros(B, H, T, dtype=torch.float32, device=keys.device)
    for i0 in range(0, T, chunk):
        i1 = min(T, i0 + chunk)
        S = kn[:, :, i0:i1] @ kn.transpose(-1, -2)  # [B,H,c,T]
        S.diagonal(offset=i0, dim1=-2, dim2=-1).zero_()  # S[i, i] = 0
        if threshold >= 0:  # S[i, i] and every invalid pair are 0 here, never above the threshold
            cand = S > threshold
        else:
            cand = (S > threshold) & valid[:, :, i0:i1, None] & valid[:, :, None, :]
            cand.diagonal(offset=i0, dim1=-2, dim2=-1).fill_(False)
        # the last candidate column of each row (a byte-wide search, not an int64 one), zeroed in place
        last = (T - 1) - cand.flip(-1).to(torch.uint8).argmax(-1, keepdim=True)  # [B,H,c,1]
        hit = S.gather(-1, last)
        S.scatter_(-1, last, torch.where(cand.gather(-1, last), torch.zeros_like(hit), hit))
        col += S.sum(-2)
    n = valid.sum(-1, keepdim=True).clamp_min(1).float()
    return masked_softmax(col / n, valid)


def run_sums(x: Tensor, seg: Tensor, longest: int) -> Tensor:
    """Deterministic sums of ``x`` [..., T] over runs of equal ``seg`` (non-decreasing ids in
    [0, T), runs at most ``longest`` slots long), indexed by run id: ``out[..., s]`` is the sum
    of the run with id ``s`` (0 for ids no run has). Each run is added up left to right, the
    order of a sequential ``scatter_add_``, with no atomics (bit-identical on every backend)."""
    t = x.shape[-1]
    acc = torch.zeros_like(x)
    for k in range(min(longest, t)):
        same = seg[..., k:] == seg[..., : t - k]
        acc[..., : t - k] += torch.where(same, x[..., k:], torch.zeros_like(x[..., k:]))
    start = torch.ones_like(seg, dtype=torch.bool)
    start[..., 1:] = seg[..., 1:] != seg[..., :-1]
    out = x.new_zeros((*x.shape[:-1], t + 1))
    return out.scatter_(-1, torch.where(start, seg, torch.full_like(seg, t)), acc)[..., :t]


def sums_by_index(values: Tensor, index: Tensor, n: int) -> Tensor:
    """Deterministic ``zeros(..., n).scatter_add_(-1, index, values)`` for float ``values`` [..., K]
    and ``index`` [..., K] in [0, n): a stable sort by index, a float64 prefix sum, and
    differences at run ends (no atomics, the same result on every run)."""
    order = torch.sort(index, dim=-1, stable=True)
    idx, v = order.values, values.gather(-1, order.indices).double()
    c = v.cumsum(-1)
    end = torch.ones_like(idx, dtype=torch.bool)
    end[..., :-1] = idx[..., 1:] != idx[..., :-1]
    start = torch.ones_like(idx, dtype=torch.bool)
    start[..., 1:] = idx[..., 1:] != idx[..., :-1]
    total = c.new_zeros((*c.shape[:-1], n + 1)).scatter_(-1, torch.where(end, idx, torch.full_like(idx, n)), c)
    before = c.new_zeros((*c.shape[:-1], n + 1)).scatter_(-1, torch.where(start, idx, torch.full_like(idx, n)),
                                                          c - v)
    return (total - before)[..., :n].to(values.dtype)


def redundancy_from_rows(
    rowsum: Tensor, last: Tensor, s_last: Tensor, valid: Tensor
) -> Tensor:
    """Finish key_redundancy from per-row statistics (used by the Triton path).

    Because S is symmetric, the column sum before the per-row exclusion equals the
    row sum; each row i then removes S[i, last[i]] from column last[i] (a deterministic
    segment sum, `sums_by_index`).
    """
    has = last >= 0
    sub = sums_by_index(torch.where(has, s_last, torch.zeros_like(s_last)), last.long().clamp_min(0),
                        rowsum.shape[-1])
    n = valid.sum(-1, keepdim=True).clamp_min(1).float()
    return masked_softmax((rowsum - sub) / n, valid)


# --------------------------------------------------------------------------- window scores
def pool_scores(scores: Tensor, key_ok: Tensor, pool: str, kernel: int) -> Tensor:
    """Masked 1-D pooling of float32 [B,H,T] along T (stride 1, same length, ``kernel``
    odd, window [t - kernel//2, t + kernel//2]), then 0 where ``key_ok`` is False.

    Only in-range tokens with ``key_ok`` (valid and candidate) take part: everything
    else counts as zero padding.  "avg" is the window sum divided by ``kernel``, i.e.
    ``F.avg_pool1d(count_include_pad=True)`` over the candidate sequence, exactly as
    SnapKV and VaSE pool (they slice the recent window off and zero-pad the edges);
    "max" is the max over ``key_ok`` neighbours (others act as -inf padding, as R-KV's
    ``max_pool1d``); "none" is the identity.  Because masked slots act exactly like edge
    padding, a left-padded row pools like the same row without padding.
    """
    if pool != "none" and kernel > 1:
        B, H, T = scores.shape
        ok = key_ok.reshape(B * H, 1, T)
        x = scores.reshape(B * H, 1, T)
        r = kernel // 2
        if pool == "avg":
            zero = torch.zeros_like(x)
            y = F.avg_pool1d(torch.where(ok, x, zero), kernel, stride=1, padding=r, count_include_pad=True)
        else:
            y = F.max_pool1d(x.masked_fill(~ok, float("-inf")), kernel, stride=1, padding=r)
        scores = y.reshape(B, H, T)
    return torch.where(key_ok, scores, torch.zeros_like(scores))


def query_weights(query_valid: Tensor) -> Tensor:
    """float32 [B,W]: 1/n_valid for valid queries, 0 otherwise (0 everywhere if none)."""
    qv = query_valid.float()
    return qv / qv.sum(-1, keepdim=True).clamp_min(1.0)


def window_attention_scores(
    queries: Tensor,
    keys: Tensor,
    key_pos: Tensor,
    key_valid: Tensor,
    query_pos: Tensor,
    query_valid: Tensor,
    scale: float,
    gqa: str = "mean",
    candidates: Optional[Tensor] = None,
    pool: str = "none",
    kernel: int = 5,
) -> Tensor:
    """Observation-window attention mass per key, float32 [B,H,T] (SnapKV / R-KV / VaSE).

    See ``kvcompose.kernels.window_attention_scores`` for the semantics.
    """
    B, Hq, W, D = queries.shape
    H, T = keys.shape[1], keys.shape[2]
    G = Hq // H
    q = queries.float().reshape(B, H, G, W, D)
    logits = torch.einsum("bhgwd,bhtd->bhgwt", q, keys.float()).mul_(scale)  # in place: one [B,H,G,W,T] buffer
    key_ok = key_valid if candidates is None else key_valid & candidates  # [B,H,T]
    allowed = (
        key_ok[:, :, None, :]
        & (key_pos[:, :, None, :] <= query_pos[None, None, :, None])
        & query_valid[:, None, :, None]
    )  # [B,H,W,T]
    if gqa == "max":
        L = logits.amax(2).masked_fill(~allowed, float("-inf"))
        p = torch.softmax(L, -1)
        p = torch.where(allowed, p, torch.zeros_like(p))  # fully masked rows: NaN -> 0
    else:
        na = ~allowed[:, :, None]
        p = torch.softmax(logits.masked_fill_(na, float("-inf")), -1)
        p = p.masked_fill_(na, 0.0).mean(2)  # fully masked rows: NaN -> 0
    s = (p * query_weights(query_valid)[:, None, :, None]).sum(2)  # mean over valid queries
    return pool_scores(s, key_ok, pool, kernel)


# --------------------------------------------------------------------------- quantization
def _pad_edge(x: Tensor, dim: int, to: int) -> Tensor:
    """Pad ``x`` along ``dim`` to length ``to`` by repeating its last slice (keeps
    min/max of a ragged last group unchanged)."""
    n = x.shape[dim]
    if n == to:
        return x
    last = x.narrow(dim, n - 1, 1)
    reps = [1] * x.dim()
    reps[dim] = to - n
    return torch.cat([x, last.repeat(reps)], dim)


def quantize(x: Tensor, bits: int, group: int, axis: str) -> tuple[Tensor, Tensor, Tensor]:
    """KIVI asymmetric min/max group quantization of float [N,T,D].

    Returns (codes uint8 [N,T,D] for 8 bits or [N,T,ceil(D/2)] packed for 4 bits — low
    nibble = even channel, high nibble = odd channel —, scale float32, zero float32),
    scale/zero of shape [N, ceil(T/group), D] for axis="channel" and
    [N, T, ceil(D/group)] for axis="token".  code = clamp(floor((x-zero)*inv+0.5)),
    inv = 1/scale (0 where scale == 0), scale = (max-min)/(2^bits-1), zero = min.
    """
    N, T, D = x.shape
    qmax = float(2**bits - 1)
    xf = x.float()
    if axis == "channel":
        ng = -(-T // group)
        xp = _pad_edge(xf, 1, ng * group).reshape(N, ng, group, D)
        mn, mx = xp.amin(2), xp.amax(2)  # [N,ng,D]
        exp = lambda s: s.repeat_interleave(group, 1)[:, :T]  # noqa: E731
    else:
        ng = -(-D // group)
        xp = _pad_edge(xf, 2, ng * group).reshape(N, T, ng, group)
        mn, mx = xp.amin(3), xp.amax(3)  # [N,T,ng]
        exp = lambda s: s.repeat_interleave(group, 2)[:, :, :D]  # noqa: E731
    scale = (mx - mn) / qmax
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.floor((xf - exp(mn)) * exp(inv) + 0.5).clamp_(0.0, qmax).to(torch.uint8)
    if bits == 4:
        if D % 2:
            q = F.pad(q, (0, 1))
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    return q.contiguous(), scale.contiguous(), mn.contiguous()


def dequantize(
    codes: Tensor, scale: Tensor, zero: Tensor, bits: int, group: int, axis: str, D: int, dtype: torch.dtype
) -> Tensor:
    """Inverse of :func:`quantize`: x = code * scale + zero (float32), cast to ``dtype``."""
    if bits == 4:
        q = torch.stack([codes & 0xF, codes >> 4], -1).flatten(-2)[..., :D]
    else:
        q = codes
    T = q.shape[1]
    if axis == "channel":
        s = scale.repeat_interleave(group, 1)[:, :T]
        z = zero.repeat_interleave(group, 1)[:, :T]
    else:
        s = scale.repeat_interleave(group, 2)[:, :, :D]
        z = zero.repeat_interleave(group, 2)[:, :, :D]
    return (q.float() * s + z).to(dtype)
