"""Test setup: Triton runs in its CPU interpreter when there is no GPU (set before any @triton.jit import).
Every kvcompose module is type- and shape-checked by jaxtyping + beartype for the whole session: the hook is
installed by jaxtyping's pytest plugin (`--jaxtyping-packages` in pyproject.toml's addopts) before any test
module is collected, so modules imported late are checked too (`tests/test_checking.py` proves it)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import settings  # noqa: E402

# The README's test command draws the same examples on every run, on every machine ("ci": derandomized, no
# example database); `HYPOTHESIS_PROFILE=explore` draws new ones (10x the examples of each property, see
# tests/helpers.py `examples`, `KVCOMPOSE_EXPLORE_FACTOR` to change it) for a developer before a change lands.
# A failure it finds becomes an `@example` of the property, so the CI profile keeps checking it.
settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", max_examples=250, deadline=None, derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
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


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny chat model saved to a folder (`--model` of the command line tests), once per module."""
    from kvcompose.testing import save_tiny_chat_model

    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "model")
