"""Long-generation drift: the reference against itself is exact, a noisy cache drifts, both scoring paths agree,
buckets average the right positions, sampled and chat-template continuations are reproducible and never end the text,
bad input is refused."""
import json

import pytest
import torch
from transformers import DynamicCache
from transformers.utils import logging as hf_logging

from oscar_hf.eval import continuations as cont
from oscar_hf.eval import long_generation as lg
from oscar_hf.eval.methods import KVMethod, get_method

from test_perplexity import random_artifact
from tiny_models import tiny_model

hf_logging.disable_progress_bar()
N = 40  # generated tokens per prompt: past the windows of the small caches below, so history is quantized


@pytest.fixture(scope="module")
def model():
    # sharp attention (a bad history read shows clearly); head_dim 64: the CLI rows' group size
    m = tiny_model("llama", initializer_range=0.2, head_dim=64)
    m.generation_config.eos_token_id = None  # every greedy token is the reference's top-1 (no suppressed EOS)
    return m


@pytest.fixture(scope="module")
def prompts():
    return torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(0))


class NoisyCache(DynamicCache):
    """A DynamicCache that stores every key with Gaussian noise (std 0.5): a deliberately bad cache."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        g = torch.Generator().manual_seed(1000 * layer_idx + key_states.shape[2])
        noise = 0.5 * torch.randn(key_states.shape, generator=g, dtype=key_states.dtype)
        return super().update(key_states + noise, value_states, layer_idx, *args, **kwargs)


class Noisy(KVMethod):
    name, fast = "noisy", False  # a real cache only: scored token by token

    def make_cache(self, model):
        return NoisyCache(config=model.config)


def test_reference_against_itself_is_exact(model, prompts):
    res = lg.long_generation(model, prompts, ["fp"], N, progress=False)
    r = res["rows"]["fp"]
    assert [x.shape for x in res["ids"]] == [(12 + N,)] * 2 and torch.equal(torch.stack(res["ids"])[:, :12], prompts)
    assert r["kl"].shape == (2, N) and (r["kl"] == 0).all() and (r["agreement"] == 1).all()
    assert r["kl_mean"] == 0 and r["agreement_mean"] == 1
    # the teacher-forced positions line up with the generated tokens: the reference's top-1 is the continuation
    assert res["reference_agreement"] == [1.0, 1.0]


def test_noisy_cache_drifts(model, prompts):
    r = lg.long_generation(model, prompts, [Noisy()], N, progress=False)["rows"]["noisy"]
    assert r["path"] == "token-by-token"
    assert (r["kl"] > 0).all() and r["kl_mean"] > 1e-3
    assert r["agreement_mean"] < 1


def test_fast_and_exact_paths_agree(model, prompts):
    """The one-forward fake-quant path and OscarCache token by token give the same drift (reference: the plain
    forward vs a DynamicCache)."""
    make = lambda: get_method("hadamard", sink=2, recent=4, group_size=32)  # noqa: E731
    fast = lg.long_generation(model, prompts, [make()], N, progress=False)["rows"]["hadamard"]
    exact = lg.long_generation(model, prompts, [make()], N, exact=True, progress=False)["rows"]["hadamard"]
    assert (fast["path"], exact["path"]) == ("fast", "token-by-token")
    assert fast["kl_mean"] > 1e-4  # quantization shows
    torch.testing.assert_close(fast["kl"], exact["kl"], atol=1e-6, rtol=1e-3)
    assert torch.equal(fast["agreement"], exact["agreement"])


def test_buckets_and_means():
    assert lg.buckets(3000) == [(0, 512), (512, 1024), (1024, 2048), (2048, 3000)]
    assert lg.buckets(4096) == [(0, 512), (512, 1024), (1024, 2048), (2048, 4096)]
    assert lg.buckets(5000)[-2:] == [(2048, 4096), (4096, 5000)]
    assert lg.buckets(100) == [(0, 100)]
    assert lg.buckets(10, edges=(4, 0, 8, 20)) == [(0, 4), (4, 8), (8, 10)]
    v = torch.stack([torch.arange(10.0), 100 + torch.arange(10.0)])  # [P=2, N=10]
    got = lg.bucket_means(v, edges=(4, 8))
    assert [(b["start"], b["end"]) for b in got] == [(0, 4), (4, 8), (8, 10)]
    # bucket [a, b) of both prompts: mean of a..b-1 and of 100+a..100+b-1
    assert [b["mean"] for b in got] == pytest.approx([51.5, 55.5, 58.5])


def test_rows_aggregate_their_positions(model, prompts):
    r = lg.long_generation(model, prompts, [Noisy()], N, edges=(8, 16, 32), progress=False)["rows"]["noisy"]
    assert [(b["start"], b["end"]) for b in r["buckets"]] == [(0, 8), (8, 16), (16, 32), (32, N)]
    for b in r["buckets"]:
        assert b["kl"] == pytest.approx(r["kl"][:, b["start"] : b["end"]].mean().item())
        assert b["agreement"] == pytest.approx(r["agreement"][:, b["start"] : b["end"]].mean().item())
    assert r["kl_mean"] == pytest.approx(r["kl"].mean().item())


@pytest.mark.parametrize("sampling", [None, cont.Sampling(temperature=1.5)])
def test_eos_is_never_generated(prompts, sampling):
    m = tiny_model("llama")
    free = torch.stack(cont.continuation(m, prompts, N, sampling, progress=False))
    m.generation_config.eos_token_id = int(free[:, 12:].flatten().mode().values)  # a token decoding picks
    ids = torch.stack(cont.continuation(m, prompts, N, sampling, progress=False))
    assert not (ids[:, 12:] == m.generation_config.eos_token_id).any()


def test_sampling_is_reproducible_and_sampled(model, prompts):
    """Same seed, same continuation, whatever the methods scored on it; another seed, another one; and it is not the
    greedy one (a sharp tiny model at temperature 1.5 leaves its top-1 often)."""
    run = lambda seed, methods: lg.long_generation(  # noqa: E731
        model, prompts, methods, N, sampling=cont.Sampling(temperature=1.5, seed=seed), progress=False)
    a, b, c = run(0, ["fp"]), run(0, [Noisy()]), run(1, ["fp"])
    assert all(torch.equal(x, y) for x, y in zip(a["ids"], b["ids"]))
    assert not any(torch.equal(x, y) for x, y in zip(a["ids"], c["ids"]))
    assert a["sampling"] == {"temperature": 1.5, "top_k": 64, "top_p": 0.95, "seed": 0}
    assert max(a["reference_agreement"]) < 1  # some draws are not the reference's top-1
    assert a["rows"]["fp"]["kl_mean"] == 0 and a["rows"]["fp"]["agreement_mean"] == 1  # scored against the same logits


def test_draw_keeps_top_k_and_the_nucleus():
    g = torch.Generator().manual_seed(0)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(2000, 4)  # [B, V]
    seen = lambda s: set(s.draw(logits, g).tolist())  # noqa: E731
    assert seen(cont.Sampling(temperature=1.0, top_k=1)) == {0}  # top-1: greedy
    assert seen(cont.Sampling(temperature=1.0, top_k=64, top_p=0.7)) == {0, 1}  # 0.5 + 0.3 covers 0.7
    assert seen(cont.Sampling(temperature=1.0, top_k=3, top_p=1.0)) == {0, 1, 2}
    assert seen(cont.Sampling(temperature=1.0, top_k=64, top_p=1.0)) == {0, 1, 2, 3}
    banned = logits.clone()
    banned[:, 0] = float("-inf")
    assert 0 not in set(cont.Sampling(temperature=1.0).draw(banned, g).tolist())


@pytest.mark.parametrize("kw", [dict(temperature=0), dict(top_k=0), dict(top_p=0), dict(top_p=1.5)])
def test_sampling_refuses_bad_parameters(kw):
    with pytest.raises(ValueError, match="sampling needs"):
        cont.Sampling(**kw)


def test_distinct_ngrams():
    assert cont.distinct_ngrams(torch.arange(10)) == 1.0
    assert cont.distinct_ngrams(torch.tensor([1, 2, 3] * 10)) == pytest.approx(3 / 27)  # a loop of 3 tokens
    assert cont.distinct_ngrams(torch.tensor([5] * 8), n=2) == pytest.approx(1 / 7)


def char_chat_tokenizer(template: str):
    """A byte-level tokenizer (one token per byte, no merges) with Gemma 3's turn tokens as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    t = Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(alphabet))}, []))
    t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<bos>", eos_token="<eos>",
                                  additional_special_tokens=["<start_of_turn>", "<end_of_turn>"])
    tok.chat_template = template
    return tok


def test_chat_prompts_and_stop_ids():
    tok = char_chat_tokenizer(cont.GEMMA3_CHAT_TEMPLATE)
    m = tiny_model("gemma3_text", vocab_size=len(tok))
    m.generation_config.eos_token_id = None
    windows = torch.stack([torch.tensor(tok("some text", add_special_tokens=False)["input_ids"])] * 2)  # [P=2, L]
    got = cont.chat_prompts(tok, windows)
    assert tok.decode(got[1]) == ("<bos><start_of_turn>user\n" + cont.INSTRUCTIONS[1] + "\n\nsome text<end_of_turn>\n"
                                  "<start_of_turn>model\n")
    assert got[0].shape != got[1].shape  # instructions differ, so do the lengths
    # the model's EOS ids alone without a chat template; with it the tokenizer's EOS and the turn's end
    assert cont.stop_ids(m) == []
    assert cont.stop_ids(m, tok) == sorted([tok.eos_token_id, tok.convert_tokens_to_ids("<end_of_turn>")])
    with pytest.raises(ValueError, match="chat template"):
        cont.chat_prompts(char_chat_tokenizer(None), windows)


def test_target_compares_every_bucket():
    def row(*agreement):
        return {"buckets": [{"agreement": a} for a in agreement]}

    res = {"rows": {"d": row(0.9, 0.8), "a": row(0.8, 0.7), "b": row(0.85, 0.8)}}
    t = lg.target(res, "d", ["a", "b"])
    assert not t["met"]  # a tie with b in the second bucket is not "closer"
    assert t["margins"]["a"] == pytest.approx([0.1, 0.1])
    assert lg.target(res, "d", ["a"])["met"]


@pytest.mark.parametrize("n", [0, -5])
def test_rejects_bad_token_counts(model, prompts, n):
    with pytest.raises(ValueError, match="n_tokens must be > 0"):
        lg.long_generation(model, prompts, ["fp"], n, progress=False)


def test_rejects_unknown_methods(model, prompts):
    with pytest.raises(ValueError, match="unknown KV method 'nope'"):
        lg.long_generation(model, prompts, ["fp", "nope"], 4, progress=False)
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        lg.method_rows(["kivi", "nope"], None, model)
    with pytest.raises(ValueError, match="--artifact"):
        lg.method_rows(["default"], None, model)


class CharTok:
    """One token per character, no special tokens (prompts from a text file without a real tokenizer)."""

    bos_token_id = None

    def __call__(self, text, add_special_tokens=False, **kw):
        return {"input_ids": [ord(c) % 250 + 3 for c in text]}


def test_cli_chat_sampled_on_gemma3_layout(tmp_path):
    """--chat --sample on a Gemma 3 layout (a sliding-window layer beside a full one): ragged prompts, the turn's end
    never generated, every row scored on the same continuation. Prompts of ~110 tokens and 260 generated: past the
    Hadamard row's 320-token window, so its KL reads INT2 rows (below the window it is 0 up to rounding, of either
    sign)."""
    tok = char_chat_tokenizer(cont.GEMMA3_CHAT_TEMPLATE)
    m = tiny_model("gemma3_text", vocab_size=len(tok), head_dim=64, initializer_range=0.2)
    text = tmp_path / "prompts.txt"
    text.write_text("\n".join(f"line {i} of a small text for prompts" for i in range(60)))
    argv = ["--methods", "fp,hadamard,kivi", "--source", str(text), "--prompts", "2", "--prompt-len", "6", "--chat",
            "--sample", "--seed", "3", "--tokens", "260", "--buckets", "16", "--smooth", "4", "--dtype", "float32",
            "--name", "chat", "--out", str(tmp_path)]
    res = lg.main(argv, model=m, tokenizer=tok)
    end = tok.convert_tokens_to_ids("<end_of_turn>")
    assert len(set(res["prompt_lens"])) == 2 and res["sampling"]["seed"] == 3
    assert all(not (x[L:] == end).any() for x, L in zip(res["ids"], res["prompt_lens"]))
    out = json.loads((tmp_path / "chat.json").read_text())
    assert out["setup"]["chat"] and len(out["distinct_4grams"]) == 2
    assert out["rows"]["BF16 DynamicCache (reference)"]["kl_mean"] == 0
    assert out["rows"]["Hadamard INT2 (G=64)"]["kl_mean"] > 0 and out["rows"]["KIVI-2 (G=64, R=128)"]["kl_mean"] > 0
    assert "sampled" in (tmp_path / "chat.md").read_text()


def test_cli_writes_report(model, tmp_path):
    art = tmp_path / "artifact"
    random_artifact(model).save_pretrained(art)
    text = tmp_path / "prompts.txt"
    text.write_text("\n".join(f"line {i} of a small text for prompts" for i in range(60)))
    argv = ["--artifact", str(art), "--methods", "default,fp,kivi,turbo2", "--source", str(text), "--prompts", "2",
            "--prompt-len", "10", "--tokens", "20", "--buckets", "8,16", "--smooth", "4", "--dtype", "float32",
            "--name", "lg", "--out", str(tmp_path)]
    lg.main(argv, model=model, tokenizer=CharTok())
    res = json.loads((tmp_path / "lg.json").read_text())
    assert list(res["rows"]) == ["defaults (artifact, auto heads)", "BF16 DynamicCache (reference)",
                                 "KIVI-2 (G=64, R=128)", "TurboQuant-style 2-bit (no windows)"]
    assert res["rows"]["BF16 DynamicCache (reference)"]["kl_mean"] == 0
    assert res["target"]["baselines"] == ["KIVI-2 (G=64, R=128)", "TurboQuant-style 2-bit (no windows)"]
    assert [(b["start"], b["end"]) for b in res["rows"]["KIVI-2 (G=64, R=128)"]["buckets"]] == [(0, 8), (8, 16), (16, 20)]
    md = (tmp_path / "lg.md").read_text()
    assert "| 0-8 KL | 0-8 top-1 |" in md and "16-20 KL" in md
    assert (tmp_path / "lg.png").stat().st_size > 0
