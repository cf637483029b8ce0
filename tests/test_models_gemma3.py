"""The Gemma-3-270M loader: the GGUF's metadata, the tokenizer rebuilt from its vocabulary, and the model."""
from __future__ import annotations

import math

import pytest
import torch

from gemma3_helpers import gemma3_model, skip_without_gemma3
from oscar_hf.eval.models import wikitext_path

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf():
    skip_without_gemma3()
    from oscar_hf.eval.models import gemma3_gguf

    return gemma3_gguf()


@pytest.fixture(scope="module")
def tok(gguf):
    from oscar_hf.eval.models import gguf_gemma_tokenizer

    return gguf_gemma_tokenizer(gguf)


def test_metadata(gguf):
    from oscar_hf.eval.models import read_gguf_metadata

    meta = read_gguf_metadata(gguf)
    assert meta["general.architecture"] == "gemma3"
    assert meta["gemma3.block_count"] == 18 and meta["gemma3.attention.head_count_kv"] == 1
    assert meta["gemma3.attention.key_length"] == 256 and meta["gemma3.attention.sliding_window"] == 512
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == len(meta["tokenizer.ggml.scores"]) == 262144
    assert tokens[int(meta["tokenizer.ggml.bos_token_id"])] == "<bos>"


def _passages():
    from oscar_hf.eval.haystack import pydoc_prose

    wiki = wikitext_path().read_text(encoding="utf-8")
    return [wiki[400_000:406_000], pydoc_prose()[:6_000],
            "def f(x):\n    return x  **  2\t# a comment\n\n\nclass A:\n        pass\n", "Ünïcödé 日本語 — 12345 ✓"]


def test_tokenizer_round_trips_and_adds_bos(tok):
    for text in _passages():
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id == 2 and ids.count(2) == 1
        assert tok.unk_token_id not in ids
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert tok.decode(ids[1:]) == text


def test_tokenizer_merges_words(tok):
    """BPE merges present: English prose is ~4 characters a token (bytes or characters alone would be ~1), and
    frequent words are one token with their leading space."""
    text = _passages()[0]
    assert len(text) / len(tok(text)["input_ids"]) > 3.5
    assert tok.convert_ids_to_tokens(tok("Hello world, the")["input_ids"]) == ["<bos>", "Hello", "▁world", ",", "▁the"]


def test_tokenizer_added_tokens_match_whole(tok):
    """Control tokens are special and whole; runs of newlines and of spaces are one user-defined token each, the
    longest that matches (as SentencePiece matches user-defined symbols)."""
    ids = tok("<start_of_turn>user\n\nhi<end_of_turn>")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["<bos>", "<start_of_turn>", "user", "\n\n", "hi", "<end_of_turn>"]
    assert tok.decode(ids, skip_special_tokens=True) == "user\n\nhi"
    assert tok.convert_ids_to_tokens(tok("a    b")["input_ids"]) == ["<bos>", "a", "▁▁▁▁", "b"]


@pytest.mark.skipif(not hasattr(__import__("transformers"), "GemmaTokenizer"), reason="no GemmaTokenizer")
def test_tokenizer_agrees_with_transformers_conversion_when_it_is_right(tok, gguf):
    """Transformers >= 5.24 converts this file's tokenizer correctly too (earlier ones lose merges and BOS): both
    give the same ids on prose. Slow (~50 s: Transformers' conversion), so only with OSCAR_SLOW_TOKENIZER=1."""
    import os

    import transformers
    from packaging.version import Version

    if not os.environ.get("OSCAR_SLOW_TOKENIZER"):
        pytest.skip("set OSCAR_SLOW_TOKENIZER=1 to compare with Transformers' own GGUF conversion (~50 s)")
    if Version(transformers.__version__) < Version("5.24"):
        pytest.skip("Transformers < 5.24 converts this tokenizer without merges / BOS")
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    for text in _passages()[:2]:
        assert tok(text)["input_ids"] == ref(text)["input_ids"]


def test_load_gemma3_model():
    model, tok = gemma3_model()
    cfg = model.config
    assert cfg.model_type == "gemma3_text" and cfg.num_hidden_layers == 18 and cfg.num_key_value_heads == 1
    assert cfg.layer_types.count("full_attention") == 3 and cfg.sliding_window == 512 and cfg.head_dim == 256
    assert getattr(cfg, "quantization_config", None) is None
    # a real language model through its own tokenizer: low perplexity on held-out WikiText
    # (31.8 on these 512 tokens; 89.8 without <bos>, ~2600 without merges)
    text = wikitext_path().read_text(encoding="utf-8")[400_000:406_000]
    ids = tok(text, return_tensors="pt").input_ids[:, :512]
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    assert math.exp(loss) < 45, math.exp(loss)
