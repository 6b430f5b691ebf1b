"""Shared test fixtures."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one torch thread, and the CI box has two shared cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


FILL_ENV = "POCKETMOE_TEST_FILL_UNINITIALIZED"


def pytest_configure(config) -> None:  # noqa: ANN001
    """With $POCKETMOE_TEST_FILL_UNINITIALIZED=1, torch.empty fills new tensors (NaN, the largest integer), as a
    GPU's caching allocator hands back stale memory: a kernel that reads an output before writing it fails
    instead of reading the zeros of a fresh host page (the engine kernels' ASan run sets it)."""
    import os

    if os.environ.get(FILL_ENV) == "1":
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True
