"""Text for calibration and evaluation: loading, the calibration / evaluation split, fixed-length token windows.
The split keeps the two disjoint and does not depend on the tokenizer (docs/calibration.md, "Passes"); evaluation
code must use :func:`evaluation_text` (or ``split_texts(...).evaluation``).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch

logger = logging.getLogger("oscar_hf")

CALIBRATION_FRACTION = 0.25
DOC_SEPARATOR = "\n\n"
_TEXT_SUFFIXES = (".txt", ".text", ".raw")
_JSON_SUFFIXES = (".json", ".jsonl", ".ndjson")


def load_texts(source: str | os.PathLike, *, data_config: str | None = None, split: str = "test",
               text_field: str = "text", cache_dir: str | None = None) -> list[str]:
    """Non-empty documents of a corpus, in order: a ``*.txt`` file is one document (byte-exact), ``*.json`` /
    ``*.jsonl`` one per record (``text_field``), anything else not a path a ``datasets`` Hub name."""
    import datasets
    path = Path(source)
    name = str(source)
    if path.is_dir():
        raise OSError(f"{path} is a directory; give a .txt / .json / .jsonl file or a datasets Hub name")
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix in _JSON_SUFFIXES:
            ds = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=cache_dir)
        else:
            if suffix not in _TEXT_SUFFIXES:
                logger.info("reading %s as plain text", path)
            ds = datasets.load_dataset("text", data_files=str(path), split="train", sample_by="document",
                                       keep_linebreaks=True, cache_dir=cache_dir)
            text_field = "text"
    elif path.suffix.lower() in _TEXT_SUFFIXES + _JSON_SUFFIXES or name.startswith((".", "/", "~")):
        raise OSError(f"data file {name!r} not found")
    else:
        try:
            ds = datasets.load_dataset(name, data_config, split=split, cache_dir=cache_dir)
        except Exception as e:  # noqa: BLE001 - hub / offline / unknown name: one clear error
            raise OSError(f"could not load dataset {name!r} (config={data_config!r}, split={split!r}): {e}") from e
    if text_field not in ds.column_names:
        raise ValueError(f"{name}: no text field {text_field!r}; columns are {ds.column_names} (use --text-field)")
    texts = [t for t in ds[text_field] if isinstance(t, str) and t.strip()]
    if not texts:
        raise ValueError(f"{name}: no non-empty text in field {text_field!r}")
    return texts


@dataclasses.dataclass(frozen=True)
class TextSplit:
    """Calibration text = ``joined[:boundary]``, evaluation text = ``joined[boundary + 1:]``."""

    calibration: str
    evaluation: str
    boundary: int
    total_chars: int
    fraction: float

    def describe(self) -> str:
        return (
            f"calibration chars [0, {self.boundary}), evaluation chars [{min(self.boundary + 1, self.total_chars)}, "
            f"{self.total_chars}) of the joined corpus (fraction {self.fraction})")


def join_texts(texts: str | Sequence[str]) -> str:
    return texts if isinstance(texts, str) else DOC_SEPARATOR.join(texts)


def split_texts(texts: str | Sequence[str], calibration_fraction: float = CALIBRATION_FRACTION) -> TextSplit:
    """The calibration / evaluation split (module docstring)."""
    if not 0.0 < calibration_fraction < 1.0:
        raise ValueError(f"calibration_fraction must lie in (0, 1), got {calibration_fraction}")
    joined = join_texts(texts)
    n = len(joined)
    b = joined.find("\n", int(n * calibration_fraction))
    if b < 0:
        b = n
    return TextSplit(joined[:b], joined[b + 1 :], b, n, calibration_fraction)


def calibration_text(source, calibration_fraction: float = CALIBRATION_FRACTION, **load_kw) -> str:
    """The calibration part of a corpus (``load_texts`` arguments as keywords)."""
    return split_texts(load_texts(source, **load_kw), calibration_fraction).calibration


def evaluation_text(source, calibration_fraction: float = CALIBRATION_FRACTION, **load_kw) -> str:
    """The held-out evaluation part of a corpus: disjoint from anything calibration ever reads."""
    return split_texts(load_texts(source, **load_kw), calibration_fraction).evaluation


def _adds_bos(tokenizer) -> bool:
    try:
        ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    except Exception:  # noqa: BLE001
        return False
    return len(ids) > 0 and ids[0] == getattr(tokenizer, "bos_token_id", None)  # (no BOS: None, never a token id)


def tokenize(tokenizer, text: str, max_tokens: int | None = None) -> torch.Tensor:
    """Token ids of ``text`` without special tokens, 1-D long. With ``max_tokens`` only a prefix is tokenized, cut at
    a line break with a margin so that the cut never changes the returned tokens."""
    chars = len(text) if max_tokens is None else max(4096, 8 * max_tokens)
    margin = 64
    while True:  # (chars at or past the end: find gives -1, the whole text)
        cut = text.find("\n", chars)
        cut = len(text) if cut < 0 else cut
        ids = tokenizer(text[:cut], add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
        if cut >= len(text) or len(ids) >= max_tokens + margin:
            break
        chars *= 2
    return torch.tensor(ids[:max_tokens], dtype=torch.long)


def token_windows(tokenizer, text: str | Sequence[str], seq_len: int, n: int | None = None, offset: int = 0,
                  add_bos: bool | str = "auto") -> torch.Tensor:
    """``[n, seq_len]`` consecutive windows of ``text``'s tokens from token ``offset``, each with a BOS first when
    ``add_bos`` (``"auto"``: when the tokenizer adds one). ``n=None``: as many as fit."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    bos = _adds_bos(tokenizer) if add_bos == "auto" else bool(add_bos)
    c = seq_len - 1 if bos else seq_len
    ids = tokenize(tokenizer, join_texts(text), None if n is None else offset + n * c)
    avail = (len(ids) - offset) // c if len(ids) > offset else 0
    if n is None:
        n = avail
    if n < 1 or avail < n:
        raise ValueError(
            f"the text has {len(ids)} tokens: not enough for {n if n else 1} window(s) of {seq_len} tokens after "
            f"offset {offset} (needs {offset + max(n, 1) * c}); use more text or a smaller budget")
    win = ids[offset : offset + n * c].view(n, c)
    if bos:
        win = torch.cat([torch.full((n, 1), tokenizer.bos_token_id, dtype=torch.long), win], dim=1)
    return win


def calibration_windows(tokenizer, text: str | Sequence[str], tokens: int, seq_len: int, holdout_windows: int = 0,
                        add_bos: bool | str = "auto") -> tuple[torch.Tensor, torch.Tensor | None]:
    """(statistics windows ``[ceil(tokens / seq_len), seq_len]``, the ``holdout_windows`` that follow them or None)
    from calibration text."""
    if tokens < 2:
        raise ValueError(f"tokens must be >= 2, got {tokens}")
    seq_len = min(seq_len, tokens)
    n = -(-tokens // seq_len)
    stats = token_windows(tokenizer, text, seq_len, n + holdout_windows, 0, add_bos)
    return stats[:n], (stats[n:] if holdout_windows else None)
