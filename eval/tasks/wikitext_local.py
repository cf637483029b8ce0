"""Loader of the offline ``wikitext_local`` task: articles of the held-out half of the WikiText-2 raw
test file (``oscar_hf.eval.models.wikitext_path()``, or ``path=`` in ``--metadata``; a relative path
resolves against THIS file's folder, not the working directory)."""
from __future__ import annotations

import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
_HEADING = re.compile(r"^ = [^=].* = $", re.M)


def articles(text: str) -> list[str]:
    """Split raw WikiText into articles at level-1 headings (`` = Title = ``)."""
    starts = [m.start() for m in _HEADING.finditer(text)] or [0]
    if starts[0] != 0:
        starts = [0, *starts]
    docs = [text[a:b].strip("\n") for a, b in zip(starts, [*starts[1:], len(text)])]
    return [d for d in docs if d.strip()]


def load(path: str | None = None, max_docs: int | None = None, max_chars: int | None = None, **kwargs):
    """``--metadata '{"max_docs": 8, "max_chars": 4000}'`` keeps the first documents / characters (quick runs)."""
    import datasets

    from oscar_hf.eval.perplexity import EVAL_START_FRACTION
    from oscar_hf.eval.models import wikitext_path

    p = Path(path) if path else wikitext_path()
    if not p.is_absolute():
        p = HERE / p
    if not p.is_file():
        raise OSError(f"wikitext_local: {p} not found")
    text = p.read_text(encoding="utf-8")
    start = text.find("\n", int(len(text) * EVAL_START_FRACTION)) + 1  # held-out half (see perplexity.py)
    docs = articles(text[start:])[1:]  # the first piece is a truncated article
    if max_docs:
        docs = docs[: int(max_docs)]
    if max_chars:
        docs = [d[: int(max_chars)] for d in docs]
    return datasets.DatasetDict({"test": datasets.Dataset.from_dict({"page": docs})})


def doc_to_target(doc) -> str:
    return doc["page"]


def process_results(doc, results):
    (loglikelihood,) = results
    words = len(re.split(r"\s+", doc["page"]))
    nbytes = len(doc["page"].encode("utf-8"))
    return {"word_perplexity": (loglikelihood, words), "byte_perplexity": (loglikelihood, nbytes),
            "bits_per_byte": (loglikelihood, nbytes)}
