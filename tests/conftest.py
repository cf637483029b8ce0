"""Session-scoped fixtures shared by the whole suite (the real model loads once)."""
from __future__ import annotations

import os
import shutil

# Triton kernels run on the CPU under the interpreter in CI. The variable must be set before triton is
# first imported (transformers and torch import it), so it is set here, before anything else.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Under pytest-xdist (scripts/run_tests.sh) the workers share the CPU's cores instead of each oversubscribing them.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

from oscar_hf.eval.models import load_model, wikitext_path  # noqa: E402

from tiny_models import tiny_model  # noqa: E402

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
