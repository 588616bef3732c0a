from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """The tiny model and a sampler's few rows gain nothing from a second thread, and on a shared
    2-core machine two threads that spin-wait for each other are several times slower (a
    schema compiling on its own thread beside the steps, more so). The fused decode kernel's
    split across threads is checked by its own tests, which keep torch's threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
