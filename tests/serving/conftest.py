"""Shared setup of the serving tests."""
import pytest
import torch

from tiny_models import tiny_model


@pytest.fixture(autouse=True, scope="package")
def one_torch_thread():
    """The serving tests run many tiny matmuls: with one intra-op thread they are not slowed by thread hand-offs (20x
    on a loaded 2-core machine); the previous count is restored after tests/serving."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model():
    """The tiny Llama most serving tests serve (2 layers, 2 KV heads of 32, 4 query heads), one per test module."""
    return tiny_model("llama")
