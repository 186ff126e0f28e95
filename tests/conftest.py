"""Test setup: Triton runs in its CPU interpreter when there is no GPU (set before any @triton.jit import).
Every kvcompose module is type- and shape-checked by jaxtyping + beartype for the whole session: the hook is
installed by jaxtyping's pytest plugin (`--jaxtyping-packages` in pyproject.toml's addopts) before any test
module is collected, so modules imported late are checked too (`tests/test_checking.py` proves it)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module (`pytestmark = pytest.mark.usefixtures("one_thread")`): tiny models gain
    nothing from threads, and on a shared, loaded CPU one thread is several times faster."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def unchecked():
    """Turn off the session's jaxtyping + beartype checks for one test: it exercises kvcompose's own argument
    checks (the errors a user without the checker sees) instead of the checker's."""
    import jaxtyping

    jaxtyping.config.update("jaxtyping_disable", True)
    yield
    jaxtyping.config.update("jaxtyping_disable", False)
