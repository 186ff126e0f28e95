import os
import subprocess
import sys

import pytest
import torch

import kvcompose.kernels as K
from kernel_testutil import TRITON_OK, gen, no_backend, randn
from kvcompose.kernels import dispatch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_device_rule(monkeypatch):
    monkeypatch.delenv("KVCOMPOSE_FORCE_REFERENCE", raising=False)
    assert dispatch.backend_for_device(torch.device("cpu")) == "reference"
    assert dispatch.backend_for_device(torch.device("meta")) == "reference"
    expect = "triton" if K.HAS_TRITON else "reference"
    assert dispatch.backend_for_device(torch.device("cuda", 0)) == expect
    assert K.select_backend(torch.zeros(2)) == "reference"
    assert K.select_backend() == "reference"


def test_env_var_and_force_reference(monkeypatch):
    monkeypatch.delenv("KVCOMPOSE_FORCE_REFERENCE", raising=False)
    cuda = torch.device("cuda")
    if not K.HAS_TRITON:
        pytest.skip("triton not importable")
    assert dispatch.backend_for_device(cuda) == "triton"
    monkeypatch.setenv("KVCOMPOSE_FORCE_REFERENCE", "1")
    assert dispatch.backend_for_device(cuda) == "reference"
    with K.force_reference(False):  # explicit code beats the env var
        assert dispatch.backend_for_device(cuda) == "triton"
    monkeypatch.setenv("KVCOMPOSE_FORCE_REFERENCE", "0")
    assert dispatch.backend_for_device(cuda) == "triton"
    with K.force_reference():
        assert dispatch.backend_for_device(cuda) == "reference"
        with K.force_reference(None):
            assert dispatch.backend_for_device(cuda) == "triton"
        assert dispatch.backend_for_device(cuda) == "reference"
    assert dispatch.backend_for_device(cuda) == "triton"
    K.force_reference(True)  # plain call: sticks until changed
    try:
        assert dispatch.backend_for_device(cuda) == "reference"
    finally:
        K.force_reference(None)
    assert dispatch.backend_for_device(cuda) == "triton"


def test_use_triton_hook_beats_force_reference():
    with K.force_reference():
        with K.use_triton(False):
            assert K.select_backend(torch.zeros(1)) == "reference"
        if TRITON_OK:
            with K.use_triton(True):
                assert K.select_backend(torch.zeros(1, device="cuda" if torch.cuda.is_available() else "cpu")) == "triton"
    assert dispatch.use_triton.current() is None and dispatch.force_reference.current() is None


@pytest.mark.skipif(not TRITON_OK, reason="no Triton path")
def test_public_functions_follow_the_switches():
    v = randn(gen(0), 1, 2, 5, 8)
    with no_backend("value_magnitude"):
        with K.use_triton(True):
            K.value_magnitude(v)  # Triton: the reference is not touched
        with K.use_triton(False), pytest.raises(AssertionError, match="reference value_magnitude called"):
            K.value_magnitude(v)
        if v.device.type == "cpu":
            with pytest.raises(AssertionError):
                K.value_magnitude(v)  # CPU default: reference


def _run(code, env_extra):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KVCOMPOSE_FORCE_REFERENCE")}
    env.update(env_extra)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.skipif(not K.HAS_TRITON, reason="triton not importable")
def test_use_triton_on_cpu_without_interpreter_is_a_clear_error():
    code = (
        "import torch, kvcompose.kernels as K\n"
        "assert not K.TRITON_INTERPRETED\n"
        "try:\n"
        "    with K.use_triton(True):\n"
        "        K.value_magnitude(torch.zeros(1, 1, 2, 4))\n"
        "except RuntimeError as e:\n"
        "    print('ERR', e)\n"
    )
    r = _run(code, {})
    assert r.returncode == 0, r.stderr
    assert "ERR" in r.stdout and "TRITON_INTERPRET=1" in r.stdout


def test_intercept_launches_records_instead_of_launching():
    """Every wrapper launches through `dispatch.launch`: an interceptor sees the kernel, grid, arguments and
    constexprs the wrapper picked (nothing runs) and answers the SM count; the switch is restored on exit."""
    import kvcompose.kernels as K

    seen = []
    keys = torch.randn(1, 2, 40, 16)
    values = torch.randn(1, 2, 40, 16)
    idx = torch.arange(0, 40, 2).expand(1, 2, 20).contiguous()
    with dispatch.intercept_launches(lambda k, grid, args, kwargs: seen.append((k, grid, kwargs)), sms=7) as ic:
        assert dispatch.multiprocessor_count(torch.device("cuda")) == 7 and ic.sms == 7
        assert dispatch.backend_for_device(torch.device("cuda")) == "triton"
        if dispatch.HAS_TRITON:
            with K.use_triton(True) if dispatch.TRITON_INTERPRETED else dispatch.force_reference(False):
                K.compact(keys, values, idx, check_indices=False)
    assert dispatch._STATE["intercept"] is None
    if dispatch.HAS_TRITON and dispatch.TRITON_INTERPRETED:
        (kernel, grid, kwargs), = seen
        assert getattr(kernel, "__name__", None) or kernel.fn.__name__  # the @triton.jit function itself
        assert grid[0] == 2 and kwargs["SEQUENTIAL"] is False and kwargs["BLOCK_K"] == 64


def test_intercept_launches_refuses_bad_arguments(unchecked):
    with pytest.raises(ValueError, match="hook"):
        dispatch.intercept_launches(None)
    with pytest.raises(ValueError, match="sms"):
        dispatch.intercept_launches(lambda *a: None, sms=0)
