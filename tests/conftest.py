"""Session-scoped fixtures shared by the whole suite (the real model loads once)."""
from __future__ import annotations

import pytest
import torch

from oscar_hf.models import load_model, tiny_model, wikitext_path

TINY_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3")


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer): SmolLM2-135M-Instruct, real weights, float32 on CPU."""
    torch.manual_seed(0)
    return load_model("smollm2", dtype=torch.float32)


@pytest.fixture(scope="session")
def wikitext_text() -> str:
    return wikitext_path().read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def wikitext_file():
    return wikitext_path()


@pytest.fixture(scope="session", params=TINY_TYPES)
def tiny(request):
    """A tiny random-initialised model of each architecture family."""
    return tiny_model(request.param)
