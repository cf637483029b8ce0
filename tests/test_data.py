"""Text loading, the calibration / evaluation split and token windows."""
from __future__ import annotations

import json

import pytest
import torch

from oscar_hf import data


class CharTokenizer:
    """One token per character (ids = code points), optional BOS: enough to test window arithmetic."""

    def __init__(self, bos: int | None = None):
        self.bos_token_id = bos

    def __call__(self, text, add_special_tokens=True, **kw):
        ids = [ord(c) for c in text]
        if add_special_tokens and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return {"input_ids": ids}


def test_load_txt_is_byte_exact(wikitext_file):
    texts = data.load_texts(wikitext_file)
    assert texts == [wikitext_file.read_text(encoding="utf-8")]


def test_load_jsonl_and_json(tmp_path):
    recs = [{"text": "first doc\nline two", "id": 1}, {"text": "", "id": 2}, {"text": "third", "id": 3}]
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in recs))
    assert data.load_texts(p) == ["first doc\nline two", "third"]  # empty documents dropped
    q = tmp_path / "d2.json"
    q.write_text(json.dumps([{"body": "x y"}, {"body": "z"}]))
    assert data.load_texts(q, text_field="body") == ["x y", "z"]
    with pytest.raises(ValueError, match="no text field 'text'.*body"):
        data.load_texts(q)


def test_load_missing_file_is_oserror(tmp_path):
    with pytest.raises(OSError, match="not found"):
        data.load_texts(tmp_path / "nope.txt")
    with pytest.raises(OSError, match="directory"):
        data.load_texts(tmp_path)


def test_split_is_disjoint_deterministic_and_at_a_line_break(wikitext_text):
    sp = data.split_texts([wikitext_text])
    assert sp.calibration + "\n" + sp.evaluation == wikitext_text
    assert wikitext_text[sp.boundary] == "\n"
    assert 0.25 <= sp.boundary / len(wikitext_text) < 0.26
    assert sp == data.split_texts(wikitext_text)  # a str and a one-document list are the same corpus
    # the calibration text is a prefix, the evaluation text a suffix: no character is in both
    assert wikitext_text.startswith(sp.calibration) and wikitext_text.endswith(sp.evaluation)
    assert len(sp.calibration) + len(sp.evaluation) + 1 == len(wikitext_text)


def test_split_of_several_documents_and_fraction():
    docs = [f"doc {i}\nbody {i}" for i in range(10)]
    sp = data.split_texts(docs, 0.5)
    joined = "\n\n".join(docs)
    assert sp.calibration + "\n" + sp.evaluation == joined
    assert sp.boundary >= len(joined) // 2
    with pytest.raises(ValueError):
        data.split_texts(docs, 1.0)
    # no line break after the cut: everything is calibration
    sp = data.split_texts(["abc"], 0.5)
    assert sp.calibration == "abc" and sp.evaluation == ""


def test_file_helpers_agree_with_split(wikitext_file, wikitext_text):
    sp = data.split_texts(wikitext_text)
    assert data.calibration_text(wikitext_file) == sp.calibration
    assert data.evaluation_text(wikitext_file) == sp.evaluation


@pytest.mark.parametrize("bos", [None, 1])
def test_token_windows_arithmetic(bos):
    tok = CharTokenizer(bos)
    text = "".join(chr(65 + i % 50) for i in range(1000))
    w = data.token_windows(tok, text, seq_len=10, n=3, offset=5)
    c = 9 if bos else 10
    assert w.shape == (3, 10) and w.dtype == torch.long
    content = w[:, 1:] if bos else w
    if bos:
        assert (w[:, 0] == bos).all()
    assert content.reshape(-1).tolist() == [ord(ch) for ch in text[5 : 5 + 3 * c]]
    assert data.token_windows(tok, text, 10, add_bos=False).shape == (100, 10)  # n=None: all that fit
    with pytest.raises(ValueError, match="not enough"):
        data.token_windows(tok, text, 10, n=101, add_bos=False)


def test_calibration_windows_follow_each_other(smollm2, wikitext_text):
    _, tok = smollm2
    cal = data.split_texts(wikitext_text).calibration
    stats, hold = data.calibration_windows(tok, cal, tokens=600, seq_len=256, holdout_windows=2)
    assert stats.shape == (3, 256) and hold.shape == (2, 256)
    ids = data.tokenize(tok, cal)
    assert torch.equal(torch.cat([stats.reshape(-1), hold.reshape(-1)]), ids[: 5 * 256])
    # prefix tokenization (what calibration uses) agrees with tokenizing the whole text
    assert torch.equal(data.tokenize(tok, cal, max_tokens=3000), ids[:3000])
    stats2, none = data.calibration_windows(tok, cal, tokens=100, seq_len=256)
    assert stats2.shape == (1, 100) and none is None


def test_calibration_tokens_never_reach_evaluation_text(smollm2, wikitext_text):
    """Decoding every calibration token gives text inside the calibration part only."""
    _, tok = smollm2
    sp = data.split_texts(wikitext_text)
    n_cal = len(data.tokenize(tok, sp.calibration))
    assert n_cal > 8192 * 1.25  # room for the default budget plus its held-out windows
    stats, hold = data.calibration_windows(tok, sp.calibration, tokens=8192, seq_len=2048, holdout_windows=1)
    decoded = tok.decode(torch.cat([stats.reshape(-1), hold.reshape(-1)]).tolist())
    assert sp.calibration.startswith(decoded)
