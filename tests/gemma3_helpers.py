"""The packaged Gemma-3-270M for tests: loaded once per process (several test modules use it), skipped with the
install line when its wheels are missing."""
from __future__ import annotations

import functools

import pytest
import torch

from oscar_hf.eval.models import GEMMA3_INSTALL, gemma3_available


def skip_without_gemma3():
    if not gemma3_available():
        pytest.skip(f"Gemma-3-270M is not installed: `{GEMMA3_INSTALL}` (scripts/setup_env.sh does it)")


@functools.lru_cache(maxsize=1)
def _load():
    from oscar_hf.eval.models import load_gemma3

    torch.manual_seed(0)
    return load_gemma3(dtype=torch.float32)


def gemma3_model():
    """(model, tokenizer): Gemma-3-270M, float32 on the CPU; the first load ever converts the GGUF (~1.5 min on 2
    cores) into the cache folder, later ones read it (~10 s)."""
    skip_without_gemma3()
    return _load()
