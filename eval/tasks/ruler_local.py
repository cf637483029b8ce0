"""Loaders of the offline ``ruler_local_*`` lm-eval tasks (samples of :mod:`oscar_hf.eval.ruler`, generated on the
fly: no download). Every task's ``custom_dataset`` receives the run's ``--model_args`` merged with ``--metadata``:

* the tokenizer that sizes the prompts: ``tokenizer`` (a name / path, or a tokenizer object from Python), else
  ``pretrained`` (``smollm2`` / ``gemma3-270m`` = the packaged GGUF's tokenizer, as ``load_model`` builds it;
  ``gguf_file`` is honoured as HFLM does);
* ``lengths``: int, list or ``"1024,2048"`` (default 4096; lm-eval RULER's ``max_seq_lengths`` is accepted);
* ``samples``: samples per length and task (default 4); ``seed`` (default 0);
* ``haystack``: text file (default WikiText-2 raw test; a relative path resolves against THIS file's folder).

Metrics: one per length (``"4096"``: mean RULER score of that length's samples), so one run gives a row per length.
"""
from __future__ import annotations

import functools
from pathlib import Path

from oscar_hf.eval import ruler

HERE = Path(__file__).resolve().parent
DEFAULT_LENGTHS = (4096,)
DEFAULT_SAMPLES = 4
_HAYSTACKS: dict = {}


@functools.cache
def _load_tokenizer(name: str, gguf_file: str | None):
    from transformers import AutoTokenizer

    from oscar_hf.eval.models import (DEFAULT_MODEL, GEMMA3, SMOLLM2_GGUF, gemma3_cache_dir, gemma3_gguf,
                                 gguf_gemma_tokenizer, smollm2_dir)

    if name == GEMMA3:  # the tokenizer load_model gives Gemma (Transformers' GGUF conversion drops merges and <bos>)
        if gguf_file is not None:
            raise ValueError(f"pretrained={name!r} is a packaged model: gguf_file is not taken with it")
        saved = gemma3_cache_dir() / "tokenizer"  # load_model's conversion, when a run has made it
        return AutoTokenizer.from_pretrained(saved) if (saved / "tokenizer.json").is_file() else \
            gguf_gemma_tokenizer(gemma3_gguf())
    if name == DEFAULT_MODEL:
        name, gguf_file = str(smollm2_dir()), gguf_file or SMOLLM2_GGUF
    return AutoTokenizer.from_pretrained(name, **({"gguf_file": gguf_file} if gguf_file else {}))


def tokenizer_from(tokenizer=None, pretrained=None, gguf_file=None, **kwargs):
    """The tokenizer named by the run's arguments (``tokenizer`` first, as HFLM does)."""
    if tokenizer is not None and not isinstance(tokenizer, str):
        return tokenizer
    if tokenizer:
        return _load_tokenizer(tokenizer, None)
    if isinstance(pretrained, str) and pretrained:
        return _load_tokenizer(pretrained, gguf_file)
    raise ValueError("ruler_local tasks size their prompts with the model's tokenizer: pass --model_args "
                     "pretrained=<name or path> (or tokenizer=...), "
                     "or --metadata '{\"tokenizer\": \"<name or path>\"}'")


def parse_lengths(lengths=None, max_seq_lengths=None) -> list[int]:
    value = lengths if lengths is not None else max_seq_lengths
    if value is None:
        return list(DEFAULT_LENGTHS)
    if isinstance(value, str):
        value = [v for v in value.replace(" ", "").split(",") if v]
    out = [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
    if not out or min(out) <= 0:
        raise ValueError(f"ruler_local: lengths must be positive token counts, got {value!r}")
    return out


def haystack_for(tok, haystack=None) -> ruler.Haystack:
    """One :class:`ruler.Haystack` per (tokenizer, file), shared by the tasks of a run."""
    path = Path(haystack) if haystack else None
    if path is not None and not path.is_absolute():
        path = HERE / path
    key = (id(tok), str(path))
    if key not in _HAYSTACKS:
        _HAYSTACKS[key] = (tok, ruler.Haystack(tok, path))  # keeps tok alive: its id stays unique
    return _HAYSTACKS[key][1]


def load(task: str, lengths=None, max_seq_lengths=None, samples=DEFAULT_SAMPLES, seed=0, haystack=None, **kwargs):
    import datasets

    hay = haystack_for(tokenizer_from(**kwargs), haystack)
    docs = [s.as_doc() for s in ruler.make_samples(task, hay, parse_lengths(lengths, max_seq_lengths), int(samples),
                                                   int(seed))]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


niah_multikey = functools.partial(load, "niah_multikey")
niah_multivalue = functools.partial(load, "niah_multivalue")
vt = functools.partial(load, "vt")
cwe = functools.partial(load, "cwe")


def doc_to_target(doc) -> str:
    return ", ".join(doc["answers"])


def process_results(doc, results):
    (generation,) = results
    return {str(doc["length"]): ruler.score(generation, doc["answers"])}
