from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

from kvdoc import Decoder, GPTConfig

# Property tests draw the same examples on every run: CI must not pass or fail by luck.
settings.register_profile("kvdoc", derandomize=True, deadline=None)
settings.load_profile("kvdoc")

# Under pytest-xdist (`make pytest` runs one worker a core) a worker's torch threads would contend
# with the other workers for the same cores; tiny tensors run fastest on one thread anyway.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture
def one_thread():
    """Tiny tensors run faster on one thread than on two that contend with other processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def model() -> Decoder:
    torch.manual_seed(0)
    return Decoder(GPTConfig()).eval()


@pytest.fixture
def stream() -> torch.Tensor:
    """A fixed 24-token stream for batch 2."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, GPTConfig().vocab_size, (2, 24), generator=g)
