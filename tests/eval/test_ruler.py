"""RULER-style suite: the generators (deterministic, sized, answerable), the scorer, and the local lm-eval tasks
end to end on a tiny random Llama (SmolLM2's tokenizer) with ``--model hf`` and ``--model oscar``."""
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from oscar_hf.eval import ruler
from oscar_hf.eval.models import SMOLLM2_GGUF, smollm2_dir

from tiny_models import tiny_model

TASKS_DIR = Path(__file__).resolve().parents[2] / "eval" / "tasks"
TOL = 32  # a prompt may fall short of its budget by this many tokens (CWE grows by whole words)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF)


@pytest.fixture(scope="module")
def hay(tok):
    return ruler.Haystack(tok)


def _task_module():
    spec = importlib.util.spec_from_file_location("ruler_local", TASKS_DIR / "ruler_local.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------------------------------------- generators
@pytest.mark.parametrize("task", ruler.TASKS)
def test_samples_are_deterministic_and_sized(task, hay):
    a = ruler.make_samples(task, hay, [1024, 2048], samples=2, seed=3)
    assert [(s.length, s.index) for s in a] == [(1024, 0), (2048, 0), (1024, 1), (2048, 1)]  # index-major
    assert a == ruler.make_samples(task, hay, [1024, 2048], samples=2, seed=3)
    assert a[0] != ruler.make_sample(task, hay, 1024, index=0, seed=4)
    for s in a:
        budget = s.length - ruler.GEN_TOKENS[task]
        assert s.n_tokens == hay.count(s.prompt) and budget - TOL <= s.n_tokens <= budget, (s.n_tokens, budget)
        assert s.prompt == f"{s.input} {s.gen_prefix}" and s.answers


def test_samples_do_not_depend_on_the_hash_seed(tiny_dir, hay):
    """Another process (another PYTHONHASHSEED: set order differs) generates the same samples."""
    code = ("import json, sys; from transformers import AutoTokenizer; from oscar_hf.eval import ruler; "
            "hay = ruler.Haystack(AutoTokenizer.from_pretrained(sys.argv[1])); "
            "print(json.dumps([ruler.make_sample(t, hay, 1024, 1).as_doc() for t in ruler.TASKS]))")
    env = dict(os.environ, PYTHONHASHSEED="12345", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-P", "-c", code, str(tiny_dir)], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert json.loads(out.splitlines()[-1]) == [ruler.make_sample(t, hay, 1024, 1).as_doc() for t in ruler.TASKS]


def test_niah_needles_answer_the_question(hay):
    s = ruler.make_sample("niah_multikey", hay, 1024, index=1)
    needles = re.findall(r"One of the special magic numbers for (\S+) is: (\d{7})\.", s.input)
    assert len(needles) == 4 and len({k for k, _ in needles}) == 4
    (key,) = re.findall(r"magic number for (\S+) mentioned", s.gen_prefix)
    assert s.answers == [v for k, v in needles if k == key]
    m = ruler.make_sample("niah_multivalue", hay, 1024, index=1)
    needles = re.findall(r"One of the special magic numbers for (\S+) is: (\d{7})\.", m.input)
    (key,) = re.findall(r"magic numbers for (\S+) mentioned", m.gen_prefix)
    assert {k for k, _ in needles} == {key} and sorted(m.answers) == sorted(v for _, v in needles)
    assert len(set(m.answers)) == 4


def test_variable_tracking_chain_resolves_to_the_gold(hay):
    for i in range(3):
        s = ruler.make_sample("vt", hay, 2048, index=i)
        env = {}
        for name, rhs in re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d{5})\.", s.input):
            env[name] = env[rhs[4:]] if rhs.startswith("VAR") else rhs  # a reference is always to an earlier VAR
        value = re.search(r"assigned the value (\d{5}) in the text above", s.input).group(1)
        assert sorted(n for n, v in env.items() if v == value) == sorted(s.answers)
        assert f"{len(s.answers)} variables are assigned the value {value}" in s.gen_prefix


@pytest.mark.parametrize("length,freqs", [(1024, (6, 1)), (4096, (30, 3))])
def test_common_words_are_the_most_frequent(hay, length, freqs):
    s = ruler.make_sample("cwe", hay, length, index=2)
    listing = s.input.split("Memorize the ones that appear most often.\n")[-1].split("\nQuestion:")[0]
    words = re.findall(r"\d+\. ([a-z]+)", listing)
    assert re.findall(r"(\d+)\. ", listing) == [str(i + 1) for i in range(len(words))]
    counts = Counter(words)
    assert {counts[w] for w in s.answers} == {freqs[0]} and len(s.answers) == 10
    assert {c for w, c in counts.items() if w not in s.answers} == {freqs[1]}
    assert not any(g in w for g in s.answers for w in counts if w != g)  # substring scoring stays exact


def test_bad_input_fails_clearly(tok, hay, tmp_path):
    with pytest.raises(ValueError, match="unknown RULER task"):
        ruler.make_sample("qa", hay, 1024)
    with pytest.raises(ValueError, match="without any filler"):
        ruler.make_sample("cwe", hay, 256)
    with pytest.raises(ValueError, match="must exceed"):
        ruler.make_sample("vt", hay, 16)
    short = tmp_path / "short.txt"
    short.write_text("A short text about nothing in particular.\n" * 40)
    with pytest.raises(ValueError, match="held-out tokens"):
        ruler.make_sample("niah_multikey", tok, 1024, haystack=short)
    with pytest.raises(OSError):
        ruler.Haystack(tok, tmp_path / "missing.txt")


def test_score_counts_gold_strings_found():
    gold = ["1234567", "7654321", "ABCDE", "river"]
    assert ruler.score(" 1234567, 7654321, abcde and RIVER.", gold) == 1.0
    assert ruler.score(" 1111111", gold) == 0.0
    assert ruler.score("7654321 River", gold) == 0.5
    with pytest.raises(ValueError):
        ruler.score("x", [])


def test_results_table_reads_lm_eval_results(tmp_path):
    res = {"config": {"model": "oscar", "model_args": "pretrained=smollm2,method=hadamard"},
           "results": {"ruler_local": {"1024,none": 0.5, "1024_stderr,none": "N/A"},
                       **{f"ruler_local_{t}": {"1024,none": i / 4} for i, t in enumerate(ruler.TASKS)}}}
    (tmp_path / "r.json").write_text(json.dumps(res))
    rows = ruler.results_table([tmp_path / "r.json"]).splitlines()
    assert rows[-1] == "| oscar (hadamard) | 1024 | 0.0 | 25.0 | 50.0 | 75.0 | 50.0 |" and len(rows) == 3


# ---------------------------------------------------------------------------------------------- lm-eval tasks
def test_task_configs_match_the_generator():
    mod = _task_module()
    for task in ruler.TASKS:
        cfg = (TASKS_DIR / f"ruler_local_{task}.yaml").read_text()
        assert f"max_gen_toks: {ruler.GEN_TOKENS[task]}" in cfg and f"ruler_local.{task}" in cfg
        assert f"ruler_local_{task}" in (TASKS_DIR / "ruler_local.yaml").read_text()
    assert mod.parse_lengths() == [4096] and mod.parse_lengths("1024, 2048") == [1024, 2048]
    assert mod.parse_lengths(max_seq_lengths=[8192]) == [8192] and mod.parse_lengths(lengths=2048) == [2048]
    with pytest.raises(ValueError):
        mod.parse_lengths([0])
    with pytest.raises(ValueError, match="tokenizer"):
        mod.tokenizer_from(method="hadamard")
    assert mod.process_results({"length": 1024, "answers": ["ab", "cd"]}, [" AB x"]) == {"1024": 0.5}


def test_tasks_size_gemma3_prompts_with_its_rebuilt_tokenizer():
    """``pretrained=gemma3-270m``: the tokenizer load_model gives Gemma (merges rebuilt, ``<bos>`` first), so a
    prompt's token count is the model's; a gguf_file beside the packaged name is refused."""
    from gemma3_helpers import gemma3_model

    _, tok = gemma3_model()
    mod = _task_module()
    got = mod.tokenizer_from(pretrained="gemma3-270m")
    text = "The special magic number for halls-reactions is: 3004173."
    assert got(text)["input_ids"] == tok(text)["input_ids"] and got(text)["input_ids"][0] == tok.bos_token_id
    with pytest.raises(ValueError, match="packaged"):
        mod.tokenizer_from(pretrained="gemma3-270m", gguf_file="x.gguf")


@pytest.fixture(scope="module")
def tiny_dir(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama", vocab_size=len(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def one_thread():
    """The tiny model gains nothing from 2 threads, and on a shared 2-core machine they can spin-wait each other."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("model,extra", [("hf", "dtype=float32"),
                                         ("oscar", "method=hadamard,sink=4,recent=16,group_size=32")])
def test_lm_eval_runs_the_suite(tiny_dir, hay, model, extra, one_thread):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import simple_parse_args_string

    import oscar_hf.eval.lm_eval_adapter  # noqa: F401  (registers --model oscar)

    args = f"pretrained={tiny_dir},{extra}"
    # what the CLI does: --model_args merged with --metadata become every task's custom_dataset kwargs
    tm = TaskManager(include_path=str(TASKS_DIR), include_defaults=False,  # skip indexing lm-eval's own ~10K yamls
                     metadata=simple_parse_args_string(args) | {"lengths": [1024], "samples": 2})
    res = lm_eval.simple_evaluate(model=model, model_args=args, tasks=["ruler_local"], limit=2, task_manager=tm,
                                  device="cpu", gen_kwargs="max_gen_toks=4", bootstrap_iters=0, log_samples=True)
    for task in ruler.TASKS:
        r = res["results"][f"ruler_local_{task}"]
        assert 0.0 <= r["1024,none"] <= 1.0 and r["sample_len"] == 2
        first = res["samples"][f"ruler_local_{task}"][0]
        assert first["arguments"][0][0] == ruler.make_sample(task, hay, 1024).prompt  # exactly the generated prompt
    assert "1024,none" in res["results"]["ruler_local"]


@pytest.mark.parametrize("method,extra", [("fp", {}), ("hadamard", dict(sink=4, recent=8, group_size=32))])
def test_question_decode_tokens_reads_the_prompt_end_through_the_cache(tiny_dir, method, extra, one_thread):
    """``question_decode_tokens=n``: the prompt's last n tokens are a forward through a cache already holding the rest.
    Through BF16 ``DynamicCache`` that changes nothing; through an INT2 cache (history past sink + recent) the first
    answer token's scores change, as those n tokens now read the quantized history instead of the exact prefill."""
    import torch

    pytest.importorskip("lm_eval")
    from oscar_hf.eval.lm_eval_adapter import OscarLM

    ctx = torch.randint(5, 200, (1, 48), generator=torch.Generator().manual_seed(3))
    scores = []
    for n in (0, 16):
        lm = OscarLM(pretrained=str(tiny_dir), method=method, question_decode_tokens=n, batch_size=1, device="cpu",
                     **extra)
        out = lm._model_generate(ctx, 48 + 4, stop=["\n\n"], do_sample=False, output_scores=True,
                                 return_dict_in_generate=True)
        assert torch.equal(out.sequences[:, :48], ctx)
        scores.append(out.scores[0])
    if method == "fp":
        torch.testing.assert_close(scores[1], scores[0], atol=1e-4, rtol=1e-4)
    else:
        assert (scores[1] - scores[0]).abs().max() > 1e-3
    with pytest.raises(ValueError, match="question_decode_tokens"):
        OscarLM(pretrained=str(tiny_dir), method="fp", question_decode_tokens=-1, batch_size=1, device="cpu")
