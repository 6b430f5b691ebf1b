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
