"""`kernels.ref.top_last`: the k largest entries, the latest index first among equal ones, whatever the row's
width (a left-padded row of a batch picks the same tokens as the row alone)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompose.kernels.ref import top_last
from helpers import examples


@settings(max_examples=examples(60), deadline=None)
@given(t=st.integers(1, 40), k=st.integers(1, 40), pad=st.integers(0, 9), levels=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_top_last_breaks_ties_by_the_latest_index_and_ignores_left_padding(t, k, pad, levels, seed):
    k = min(k, t)
    g = torch.Generator().manual_seed(seed)
    key = torch.randint(0, levels, (3, t), generator=g).float()  # few levels: many exact ties
    got = top_last(key, k)
    for r in range(3):
        want = sorted(range(t), key=lambda i: (-float(key[r, i]), -i))[:k]  # largest, then latest
        assert got[r].tolist() == want
    padded = torch.cat([torch.full((3, pad), float("-inf")), key], dim=-1)  # left padding never wins
    assert torch.equal(top_last(padded, k) - pad, got)
