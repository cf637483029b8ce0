"""The texts the needles sit in (:mod:`.needle`) and the held-out prose the perplexity evaluation reads: a repeated
filler, WikiText's held-out half, and the English prose of the Python language reference (``pydoc_data.topics``,
stdlib, offline); and the BOS a tokenizer starts a text with."""
from __future__ import annotations

import re

import torch

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def bos_ids(tokenizer) -> list[int]:
    """``[bos]`` if ``tokenizer`` starts a text with BOS (Gemma's ``<bos>``, its attention sink), else ``[]``."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return [bos] if bos is not None and tokenizer("a")["input_ids"][:1] == [bos] else []


def filler_ids(tokenizer, n_tokens: int) -> torch.Tensor:
    ids = tokenizer(FILLER, add_special_tokens=False)["input_ids"]
    return torch.tensor((ids * (n_tokens // len(ids) + 1))[:n_tokens])


def pydoc_prose(topics: dict[str, str] | None = None) -> str:
    """English prose of the Python language reference shipped with the stdlib (``pydoc_data.topics``), markup
    removed: indented blocks (code, grammar, tables), headings, footnotes and version notes are dropped, each
    kept paragraph is joined into one line; paragraphs separated by blank lines, topics in name order."""
    if topics is None:
        from pydoc_data.topics import topics
    paragraphs = []
    for name in sorted(topics):
        for par in re.split(r"\n\s*\n", topics[name]):
            lines = par.split("\n")
            if any(line.startswith((" ", "\t")) for line in lines):  # code, grammar, indented notes
                continue
            if len(lines) >= 2 and re.fullmatch(r"[*=\-~^\"]{3,}", lines[-1].strip()):  # a heading
                continue
            text = re.sub(r"\s+", " ", " ".join(lines)).strip()
            text = re.sub(r"\[\d+\]", "", text)  # footnote marks
            text = re.sub(r"\*([^*\s][^*]*?)\*", r"\1", text)  # *emphasis*
            if (len(text) < 80 or ">>>" in text or not text.endswith((".", "?", "!"))
                    or text.startswith(("-[", "[", "See also", "Added in", "Changed in", "Deprecated"))):
                continue
            paragraphs.append(text)
    return "\n\n".join(paragraphs)


def load_haystack(tokenizer, kind: str, n_tokens: int) -> torch.Tensor:
    """``[n_tokens]`` haystack ids: ``"wikitext"`` (held-out half), ``"filler"`` (repeated sentences) or
    ``"pydoc"`` (:func:`pydoc_prose`)."""
    if kind == "wikitext":
        from .perplexity import evaluation_ids
        return evaluation_ids(tokenizer, n_tokens)
    if kind == "filler":
        return filler_ids(tokenizer, n_tokens)
    if kind == "pydoc":
        from oscar_hf.data import tokenize
        ids = tokenize(tokenizer, pydoc_prose(), n_tokens)
        if len(ids) < n_tokens:
            raise ValueError(f"the pydoc prose has only {len(ids)} tokens, {n_tokens} requested")
        return ids
    raise ValueError(f"unknown haystack {kind!r}; known: wikitext, filler, pydoc")
