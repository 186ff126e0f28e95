"""The jaxtyping annotations of the public kernels accept every valid call (all float
dtypes, both backends) and reject shape contradictions."""

import inspect

import pytest
import torch
from beartype import beartype
from jaxtyping import TypeCheckError, jaxtyped

import kvcompose.kernels as K
from kernel_testutil import DEVICE, DTYPES, TRITON_OK, gen, rand_bool, randn


def checked(name):
    return jaxtyped(typechecker=beartype)(inspect.unwrap(getattr(K, name)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("triton", [False, True])
def test_annotations_accept_valid_calls(dtype, triton):
    if triton and not TRITON_OK:
        pytest.skip("no Triton path")
    g = gen(0)
    B, H, G, W, T, D = 2, 2, 2, 3, 11, 16
    keys, values = randn(g, B, H, T, D, dtype=dtype), randn(g, B, H, T, D, dtype=dtype)
    idx = torch.arange(4, device=DEVICE).expand(B, H, 4).contiguous()
    valid = rand_bool(g, B, H, T)
    with K.use_triton(triton):
        k, v = checked("compact")(keys, values, idx)
        checked("compact")(keys, values, idx, out_keys=torch.empty_like(k), out_values=None)
        checked("value_magnitude")(values, "l2")
        checked("key_redundancy")(keys, valid, 0.5)
        checked("window_attention_scores")(
            randn(g, B, H * G, W, D, dtype=dtype), keys, torch.arange(T, device=DEVICE).expand(B, H, T),
            valid, torch.arange(T - W, T, device=DEVICE), rand_bool(g, B, W), 0.25,
            gqa="max", candidates=valid, pool="avg", kernel=3,
        )
        q = checked("quantize")(keys, 4, 8, "channel")
        checked("quantize")(keys[0, 0], 8, 8, "token")
        checked("dequantize")(q)
        checked("dequantize")(q, torch.float32)


def test_annotations_reject_shape_contradictions():
    g = gen(1)
    keys = randn(g, 1, 2, 5, 8)
    with pytest.raises(TypeCheckError):
        checked("compact")(keys, randn(g, 1, 2, 6, 8), torch.zeros(1, 2, 3, dtype=torch.long, device=DEVICE))
    with pytest.raises(TypeCheckError):
        checked("key_redundancy")(keys, rand_bool(g, 1, 3, 5), 0.5)
