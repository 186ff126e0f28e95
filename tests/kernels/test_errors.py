"""Bad inputs raise ValueError with a message naming the kernel and the problem.

Under the project's jaxtyping import hook (tests/conftest.py) a shape or dtype that
contradicts the jaxtyping annotations is rejected even earlier, with
``jaxtyping.TypeCheckError`` (a TypeError).  So each case checks the kernel's own
ValueError on the undecorated function (``inspect.unwrap``) and that the public,
possibly decorated, function raises one of the two.
"""

import inspect

import pytest
import torch

import kvcompose.kernels as K

F32 = torch.float32
B, H, T, D = 1, 2, 6, 8


def t(*shape, dtype=F32, device="cpu"):
    if dtype == torch.bool:
        return torch.ones(*shape, dtype=dtype, device=device)
    if dtype in (torch.int64, torch.int32):
        return torch.zeros(*shape, dtype=dtype, device=device)
    return torch.zeros(*shape, dtype=dtype, device=device)


def win(**over):
    args = dict(queries=t(B, 4, 3, D), keys=t(B, H, T, D), key_pos=t(B, H, T, dtype=torch.int64),
                key_valid=t(B, H, T, dtype=torch.bool), query_pos=t(3, dtype=torch.int64),
                query_valid=t(B, 3, dtype=torch.bool), scale=0.5)
    args.update(over)
    return args


CASES = [
    # compact
    ("compact", dict(keys=t(H, T, D), values=t(H, T, D), idx=t(H, 2, dtype=torch.int64)), "keys must have 4 dims"),
    ("compact", dict(keys=t(B, H, T, D), values=t(B, H, T + 1, D), idx=t(B, H, 2, dtype=torch.int64)),
     "values must have shape"),
    ("compact", dict(keys=t(B, H, T, D), values=t(B, H, T, D), idx=t(B, H + 1, 2, dtype=torch.int64)),
     "idx must have shape"),
    ("compact", dict(keys=t(B, H, T, D), values=t(B, H, T, D), idx=t(B, H, 2)), "idx must be an integer"),
    ("compact", dict(keys=t(B, H, T, D, dtype=torch.int64), values=t(B, H, T, D), idx=t(B, H, 2, dtype=torch.int64)),
     "keys must be a float"),
    ("compact", dict(keys=t(B, H, T, D), values=t(B, H, T, D, device="meta"), idx=t(B, H, 2, dtype=torch.int64)),
     "one device"),
    ("compact", dict(keys=t(B, H, T, D), values=t(B, H, T, D), idx=t(B, H, 2, dtype=torch.int64),
                     out_keys=t(B, H, 3, D)), "out_keys must have shape"),
    ("compact", dict(keys=t(B, H, T, D), values=t(B, H, T, D), idx=t(B, H, 2, dtype=torch.int64),
                     out_values=t(B, H, 2, D, dtype=torch.float16)), "out_values dtype"),
    # value_magnitude
    ("value_magnitude", dict(values=t(H, T, D)), "values must have 4 dims"),
    ("value_magnitude", dict(values=t(B, H, T, D), kind="linf"), "kind must be one of"),
    # key_redundancy
    ("key_redundancy", dict(keys=t(B, H, T), valid=t(B, H, T, dtype=torch.bool)), "keys must have 4 dims"),
    ("key_redundancy", dict(keys=t(B, H, T, D), valid=t(B, H, T + 1, dtype=torch.bool)), "valid must have shape"),
    ("key_redundancy", dict(keys=t(B, H, T, D), valid=t(B, H, T)), "valid must be a bool"),
    ("key_redundancy", dict(keys=t(B, H, T, D), valid=t(B, H, T, dtype=torch.bool, device="meta")), "one device"),
    ("key_redundancy", dict(keys=t(B, H, T, D), valid=t(B, H, T, dtype=torch.bool), threshold=float("nan")),
     "threshold must be a finite"),
    # window_attention_scores
    ("window_attention_scores", win(queries=t(4, 3, D)), "queries must have 4 dims"),
    ("window_attention_scores", win(queries=t(B, 3, 3, D)), "multiple of kv heads"),
    ("window_attention_scores", win(queries=t(B, 4, 3, D + 1)), "must match keys"),
    ("window_attention_scores", win(queries=t(B, 4, 3, D, dtype=torch.float16)), "queries dtype"),
    ("window_attention_scores", win(key_pos=t(B, H, T - 1, dtype=torch.int64)), "key_pos must have shape"),
    ("window_attention_scores", win(key_valid=t(B, H, T)), "key_valid must be a bool"),
    ("window_attention_scores", win(query_pos=t(4, dtype=torch.int64)), "query_pos must have shape"),
    ("window_attention_scores", win(query_valid=t(B + 1, 3, dtype=torch.bool)), "query_valid must have shape"),
    ("window_attention_scores", win(candidates=t(B, H, T + 2, dtype=torch.bool)), "candidates must have shape"),
    ("window_attention_scores", win(key_pos=t(B, H, T, dtype=torch.int64, device="meta")), "one device"),
    ("window_attention_scores", win(gqa="min"), "gqa must be one of"),
    ("window_attention_scores", win(pool="sum"), "pool must be one of"),
    ("window_attention_scores", win(pool="avg", kernel=4), "kernel must be a positive odd"),
    ("window_attention_scores", win(scale=float("inf")), "scale must be a finite"),
    # quantize
    ("quantize", dict(x=t(D)), "x must have at least 2 dims"),
    ("quantize", dict(x=t(T, D), bits=3), "bits must be 4 or 8"),
    ("quantize", dict(x=t(T, D), bits=2), "bits must be 4 or 8"),
    ("quantize", dict(x=t(T, D), group=24), "group must be a power of two"),
    ("quantize", dict(x=t(T, D), axis="head"), "axis must be one of"),
    ("quantize", dict(x=t(T, D, dtype=torch.int64)), "x must be a float"),
]


@pytest.mark.parametrize("name,kwargs,match", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_raises_value_error(name, kwargs, match):
    fn = getattr(K, name)
    with pytest.raises(ValueError, match=match):
        inspect.unwrap(fn)(**kwargs)
    with pytest.raises((ValueError, TypeError)):  # TypeError: the jaxtyping hook, if active
        fn(**kwargs)


def test_dequantize_rejects_non_qtensor_and_tampered_qtensor():
    with pytest.raises((ValueError, TypeError)):
        K.dequantize(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="expected a QTensor"):
        inspect.unwrap(K.dequantize)(torch.zeros(3, 4))
    q = K.quantize(torch.randn(5, 8), 4, 4, "token")
    bad = K.QTensor(q.codes[:, :3], q.scale, q.zero, q.bits, q.group, q.axis, q.shape, q.dtype)
    with pytest.raises(ValueError, match="codes must be uint8"):
        K.dequantize(bad)
    with pytest.raises(ValueError, match="dtype must be"):
        K.dequantize(q, torch.int8)


def test_flag_type_checked():
    with pytest.raises((ValueError, TypeError)):
        K.force_reference("yes")
