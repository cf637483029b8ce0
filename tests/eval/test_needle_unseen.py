"""The unseen needle format (``locker``): prompt geometry, no overlap with calibration's probes, the code scorer,
the shared prefill (equal to one prefill per method), and a tiny end-to-end CLI run."""
import json
import random
import re

import pytest
import torch

from oscar_hf.calibration.retrieval_heads import probe_needles
from oscar_hf.data import split_texts
from oscar_hf.eval.haystack import load_haystack, pydoc_prose
from oscar_hf.eval.methods import get_method
from oscar_hf.eval.needle import (
    FORMATS,
    KEYS,
    LOCKER,
    MAGIC_NUMBER,
    answer,
    answer_nll,
    make_cells,
    make_needle_prompt,
    prefill_kv,
    score_code,
    write_prefix,
)

from tiny_models import tiny_model


class ByteTok:
    """A reversible tokenizer stand-in: one token per character, id = code point (clamped into a 256 vocab)."""

    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False, **kw):
        return {"input_ids": [min(ord(c), 255) or 1 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(int(i)) for i in ids)


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    w = words(text)
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


def locker_texts(n: int = 40, seed: int = 0) -> list[str]:
    """Filled needle + question sentences of the locker format."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        key, value = LOCKER.draw(rng)
        out.append(LOCKER.needle.format(key=key, value=value) + " " + LOCKER.question.format(key=key))
    return out


# ------------------------------------------------------------------------------------------ prompt builder
@pytest.mark.parametrize("depth", [0.1, 0.3, 0.5, 0.7, 0.9])
@pytest.mark.parametrize("length,offset", [(400, 0), (1000, 37)])
def test_locker_needle_at_requested_depth_and_exact_length(depth, length, offset):
    tok = ByteTok()
    hay = torch.arange(3000) % 200 + 40  # distinct positions, to check which haystack slice is used
    key, value = "teal lynx", "KVRT-04813"
    ctx, q, at = make_needle_prompt(tok, hay, length, depth, key, value, LOCKER, offset)
    assert len(ctx) + len(q) == length
    needle = torch.tensor(tok(" " + LOCKER.needle.format(key=key, value=value) + " ")["input_ids"])
    n_hay = len(ctx) - len(needle)
    assert torch.equal(ctx[at : at + len(needle)], needle)
    assert abs(at / n_hay - depth) <= 1 / n_hay
    assert torch.equal(torch.cat([ctx[:at], ctx[at + len(needle) :]]), hay[offset : offset + n_hay])
    assert tok.decode(q.tolist()) == LOCKER.question.format(key=key)
    assert value in tok.decode(ctx.tolist()) and value not in tok.decode(q.tolist())


def test_prompt_rejects_a_haystack_too_short_for_the_offset():
    tok = ByteTok()
    hay = torch.full((1000,), 50)
    make_needle_prompt(tok, hay, 900, 0.5, "teal lynx", "KVRT-04813", LOCKER, 0)
    with pytest.raises(ValueError, match="haystack too small"):
        make_needle_prompt(tok, hay, 900, 0.5, "teal lynx", "KVRT-04813", LOCKER, 400)
    with pytest.raises(ValueError, match="offset"):
        make_needle_prompt(tok, hay, 900, 0.5, "teal lynx", "KVRT-04813", LOCKER, -1)


def test_magic_number_cells_are_unchanged():
    """The old format draws exactly the needles it always drew (earlier results and resumed runs stay valid)."""
    rng = random.Random(3)
    old = [(L, d, rng.choice(KEYS), str(rng.randint(1_000_000, 9_999_999))) for _ in range(2) for L in (1024, 2048)
           for d in (0.0, 0.5)]
    assert make_cells([1024, 2048], [0.0, 0.5], 2, 3) == old == make_cells([1024, 2048], [0.0, 0.5], 2, 3, MAGIC_NUMBER)


def test_locker_cells_are_seeded_and_distinct():
    a = make_cells([1024], [0.1, 0.5, 0.9], 3, 0, LOCKER)
    assert a == make_cells([1024], [0.1, 0.5, 0.9], 3, 0, LOCKER)
    assert a != make_cells([1024], [0.1, 0.5, 0.9], 3, 1, LOCKER)
    assert len({v for *_, v in a}) == len(a)  # every needle of a run has its own code


# ------------------------------------------------------------------------------------------ unseen by calibration
def _probe_texts(tok, n=24):
    """The fact sentences and question + answer texts of calibration's retrieval-head probes (as built there)."""
    hay = torch.tensor(tok("#" * 2000)["input_ids"])  # a haystack that strips off cleanly
    probes = probe_needles(tok, hay, n=n, lengths=(256, 512))
    facts = [tok.decode(p.ids[p.fact[0] : p.fact[1]].tolist()) for p in probes]
    asks = [tok.decode(p.ids[p.fact[1] :].tolist()).lstrip("#") for p in probes]
    return facts, asks


def test_locker_shares_no_word_4gram_with_the_probes_or_the_magic_number_needle():
    tok = ByteTok()
    facts, asks = _probe_texts(tok)
    assert any("access code" in f for f in facts) and any("?" in a for a in asks)  # the probes really were read
    probe = set().union(*(ngrams(t, 4) for t in facts + asks))
    rng = random.Random(0)
    magic = set()
    for _ in range(20):
        key, value = MAGIC_NUMBER.draw(rng)
        magic |= ngrams(MAGIC_NUMBER.needle.format(key=key, value=value) + MAGIC_NUMBER.question.format(key=key), 4)
    mine = set().union(*(ngrams(t, 4) for t in locker_texts()))
    assert mine and probe and magic
    assert not mine & probe, mine & probe
    assert not mine & magic, mine & magic
    # no key word is a probe name or a magic-number key word
    key_words = {w for k in LOCKER.keys for w in words(k)}
    assert not key_words & set(words(" ".join(facts))) and not key_words & {w for k in KEYS for w in words(k)}


def test_locker_values_differ_from_the_probe_digits():
    tok = ByteTok()
    facts, _ = _probe_texts(tok)
    probe_values = {m for f in facts for m in re.findall(r"\d+", f)}
    assert probe_values and all(len(v) == 7 for v in probe_values)
    rng = random.Random(0)
    codes = [LOCKER.draw(rng)[1] for _ in range(500)]
    assert all(re.fullmatch(r"[A-HJ-NP-Z]{4}-\d{5}", c) for c in codes)
    assert not any(re.search(r"\d{6,}", c) for c in codes)  # never a 7-digit (probe / magic-number) value
    assert not set(codes) & probe_values
    assert len({c.split("-")[1] for c in codes}) > 450  # seeded but spread


def test_pydoc_haystack_is_prose_and_not_wikitext(wikitext_text):
    text = pydoc_prose()
    assert len(text) > 100_000
    for marker in (">>>", "::=", "**********", "-[ Footnotes ]-"):
        assert marker not in text
    assert "\n    " not in text  # no indented code block survived
    cal = split_texts(wikitext_text).calibration  # the probes' haystack is calibration text
    mine, wiki = ngrams(text, 8), ngrams(cal, 8)
    assert len(mine & wiki) / len(mine) < 1e-3


def test_load_haystack_pydoc_length_and_unknown_kind():
    tok = ByteTok()
    ids = load_haystack(tok, "pydoc", 5000)
    assert ids.shape == (5000,)
    assert tok.decode(ids[:200].tolist()) == pydoc_prose()[:200]
    with pytest.raises(ValueError, match="unknown haystack"):
        load_haystack(tok, "novels", 10)
    assert set(FORMATS) == {"magic-number", "locker"}


# ------------------------------------------------------------------------------------------ scorer
@pytest.mark.parametrize("text,ok", [
    (" KVRT-04813.", True), ("KVRT-04813", True), (" KVRT-04813 and then QQQQ-11111", True),
    (" the code is KVRT-04813", True),
    (" KVRT-04812", False), (" KVRT-048131", False), (" KVRT04813", False), (" kvrt-04813", False),
    (" XKVRT-04813", False), (" KVRT-4813", False), (" QQQQ-11111 then KVRT-04813", False), (" 04813", False),
    ("", False), (" KVRT", False),
])
def test_code_scorer(text, ok):
    assert score_code(text, "KVRT-04813") is ok


# ------------------------------------------------------------------------------------------ shared prefill
def _prompt(length=300):
    tok = ByteTok()
    hay = load_haystack(tok, "pydoc", 2000)  # ids < 256: the tiny model's vocabulary
    ctx, q, at = make_needle_prompt(tok, hay, length, 0.4, "teal lynx", "KVRT-04813", LOCKER)
    return tok, ctx, q, at


@pytest.mark.parametrize("kind", ["fp", "hadamard", "prefill-offset", "fp-heads"])
def test_shared_prefill_equals_one_prefill_per_method(kind):
    """Writing one exact prefill into a fresh cache gives the cache the model's own prefill would have: the same
    answer NLL and greedy answer (with the needle in the INT2 history)."""
    model = tiny_model("llama")
    tok, ctx, q, at = _prompt()
    W = dict(sink=4, recent=16, group_size=32)
    m = {"fp": lambda: get_method("fp"),
         "hadamard": lambda: get_method("hadamard", **W),
         "prefill-offset": lambda: get_method("hadamard", key_offset="prefill", **W),
         "fp-heads": lambda: get_method("hadamard", retrieval_heads=((1, 0),), **W)}[kind]()
    assert 4 < at < len(ctx) - 16
    prefix = prefill_kv(model, ctx)
    before = [(k.clone(), v.clone()) for k, v in prefix]
    make = lambda: m.make_cache(model)  # noqa: E731
    nll, n = answer_nll(model, tok, ctx, q, "KVRT-04813", make)
    nll_s, n_s = answer_nll(model, tok, ctx, q, "KVRT-04813", make, prefix_kv=prefix)
    assert n == n_s and abs(nll - nll_s) < 1e-5 * max(1.0, abs(nll))
    assert answer(model, tok, ctx, q, make, 8) == answer(model, tok, ctx, q, make, 8, prefix_kv=prefix)
    for (k0, v0), (k1, v1) in zip(before, prefix):  # the shared prefix is not written to by any method
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    if kind != "fp":  # and a quantized cache does read a different history than the exact one
        fp_nll, _ = answer_nll(model, tok, ctx, q, "KVRT-04813", lambda: get_method("fp").make_cache(model),
                               prefix_kv=prefix)
        assert abs(fp_nll - nll_s) > 1e-4


def test_write_prefix_rejects_used_caches_and_other_layer_kinds():
    from transformers import DynamicCache

    model = tiny_model("llama")
    _, ctx, _, _ = _prompt()
    prefix = prefill_kv(model, ctx)
    cache = get_method("fp").make_cache(model)
    write_prefix(cache, prefix)
    assert cache.get_seq_length() == len(ctx)
    with pytest.raises(ValueError, match="fresh cache"):
        write_prefix(cache, prefix)
    with pytest.raises(ValueError, match="layers"):
        write_prefix(get_method("fp").make_cache(model), prefix[:1])
    sliding = DynamicCache(config=tiny_model("gemma3_text").config)  # layer 0: a sliding window
    with pytest.raises(ValueError, match="cannot write a shared prefix"):
        write_prefix(sliding, prefix)
    with pytest.raises(ValueError, match="at least one token"):
        answer(model, ByteTok(), ctx, ctx[:0], lambda: get_method("fp").make_cache(model))


# ------------------------------------------------------------------------------------------ end to end
def test_cli_end_to_end_on_a_tiny_llama(tmp_path):
    """The grid runner on a tiny random Llama (head_dim 64, so OscarCache(model)'s defaults apply as they are):
    JSON (command, setup, accuracy per method x length x depth, answers), markdown table and heatmap PNG."""
    from oscar_hf.eval.needle_cli import main

    model = tiny_model("llama", head_dim=64)
    argv = ["--format", "locker", "--haystack", "pydoc", "--methods", "fp,default", "--lengths", "600,700",
            "--depths", "0.3,0.7", "--trials", "2", "--hay-stride", "50", "--share-prefill", "--out", str(tmp_path),
            "--name", "tiny"]
    main(argv, model=model, tokenizer=ByteTok())
    res = json.loads((tmp_path / "tiny.json").read_text())
    assert res["command"] == "python -P scripts/eval_needle.py " + " ".join(argv)
    s = res["setup"]
    assert s["format"] == "locker" and s["haystack"] == "pydoc" and s["share_prefill"] is True
    assert s["user_caches"]["OscarCache(model)"]["config"]["method"] == "hadamard"
    assert set(res["accuracy"]) == {"FP32 DynamicCache", "OscarCache(model)"}
    for acc in res["accuracy"].values():
        assert set(acc) == {"600", "700"} and all(set(d) == {"0.3", "0.7"} for d in acc.values())
    raw = res["answers"]
    assert len(raw) == 2 * 2 * 2 * 2
    assert all(re.fullmatch(r"[A-HJ-NP-Z]{4}-\d{5}", r["value"]) for r in raw)
    assert {r["haystack_offset"] for r in raw} == {0, 50}
    for r in raw:  # the records score what they say they score
        assert r["correct"] is score_code(r["answer"], r["value"])
    md = (tmp_path / "tiny.md").read_text()
    assert md.startswith("Command: `python -P scripts/eval_needle.py --format locker")
    assert "| FP32 DynamicCache | 600 |" in md and "| OscarCache(model) | 700 |" in md
    assert "OscarCache(model) / FP32 DynamicCache:" in md
    assert (tmp_path / "tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="unknown --methods"):
        main(argv[:5] + ["fp,bogus"] + argv[6:], model=model, tokenizer=ByteTok())


def test_cli_quantizer_and_window_reach_the_artifact_rows(tmp_path):
    """--quantizer sets OscarConfig.quantizer on the rows built from the artifact (the user's cache included);
    --artifact-sink / --artifact-recent / --artifact-group-size the artifact row's windows and group size."""
    from oscar_hf import OscarRotations
    from oscar_hf.eval.needle_cli import main

    model = tiny_model("llama", head_dim=64)
    art = tmp_path / "art"
    OscarRotations.builtin(model, "hadamard").save_pretrained(art)
    argv = ["--format", "locker", "--haystack", "pydoc", "--methods", "oscar,artifact", "--artifact", str(art),
            "--quantizer", "std", "--artifact-sink", "8", "--artifact-recent", "40", "--artifact-group-size", "32",
            "--lengths", "600", "--depths", "0.5", "--out", str(tmp_path), "--name", "q"]
    main(argv, model=model, tokenizer=ByteTok())
    setup = json.loads((tmp_path / "q.json").read_text())["setup"]
    assert setup["oscar"]["quantizer"] == "std"
    ((label, user),) = setup["user_caches"].items()
    assert user["config"]["quantizer"] == "std"
    assert (user["config"]["sink"], user["config"]["recent"], user["config"]["group_size"]) == (8, 40, 32)
    assert label == "OscarCache.from_pretrained(art, quantizer=std, sink=8, recent=40, group_size=32)"
