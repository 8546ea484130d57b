import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    # These tests run thousands of tiny ops; on a busy 2-core host OpenMP's barrier waits made
    # them 5-10x slower with torch's default thread count, and one thread computes the same.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
