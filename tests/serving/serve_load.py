#!/usr/bin/env python
"""Load test of the real OSCAR server: ``scripts/serve.py`` (``transformers serve --continuous-batching`` with OSCAR's
paged INT2 store) started as a process and driven over HTTP on loopback with OpenAI-style completion requests
(``/v1/completions``, streamed and not) from ``--concurrency`` threads; every answer is checked.

    python tests/serving/serve_load.py --profile tiny --out serve_load.json                 # CPU, about a minute
    python tests/serving/serve_load.py --profile qwen3-8b --out serve_load_h200.json        # GPU

Models: random weights and a tokenizer (``--tokenizer``), saved to a temporary directory that the server loads by
path; each model's vocabulary is the tokenizer's. The tokenizer: ``chars`` (the ``qwen3-8b`` profile's default), one
token a character (printable ASCII and the newline) and an EOS, built here offline (:func:`char_tokenizer`), so that a
served text has one tokenization, which the GPU profile's token check needs (below); ``smollm2`` (the ``tiny``
profile's default), SmolLM2's 49,152-entry BPE vocabulary from the packaged GGUF, whose multi-character and
byte-fallback tokens exercise the server's incremental decoding; or a saved tokenizer's directory. The prompts are
random words (mapped to the tokenizer's alphabet). Model A: ``tiny`` a tiny Llama; ``qwen3-8b`` Qwen3-8B's layers
(36 x 4096, 32 query / 8 KV heads of 128; Qwen's own tokenizer is not on the GPU machine). Model B, of another shape,
is the model switch. No model is pinned: requests name theirs by path.

The run, bounded in count (``--requests``) and time (``--deadline`` seconds of load): one warm-up request to A; phase 1,
``--share`` of the requests to A from the threads, of mixed kinds: streamed and plain requests (most), a stream the
client closes after its first text (cancellation), a stream the client leaves before any answer, a pair with one
``X-Request-ID`` (the second sent while the first streams; the first is then read to its end, and the id sent once
more), a prompt longer than the whole page pool, malformed JSON and bad fields; phase 2, requests to B (a switch: A's
manager stops); phase 3, the rest to A (a switch back); last, one request to B, so that A's manager stops again after
all of its load.

Checks (exit status 1 when one fails; each is in the JSON):

* every well-formed, non-cancelled answer is its prompt's greedy run alone through ``OscarCache`` (``generate``, the
  model's own ``eos_token_id``): the first ``max_tokens`` tokens decoded as the server decodes them (special tokens
  skipped) and ``usage.completion_tokens`` of them; a cancelled stream's text so far is a prefix of that. With
  ``--tie-tol`` 0 (the CPU profile, float32) any other text is a wrong stream. With ``--tie-tol`` > 0 (BF16 on the
  GPU: batched and single-request arithmetic round differently, and a random model's top-2 logits are often closer
  than that) a stream that leaves the reference is checked token by token instead (``forced_check.py``): the
  reference teacher-forced on the stream's own tokens, each served token within ``tie_tol`` x the step's largest
  |logit| of the step's best (``followed``), else ``wrong``. The check recovers the stream's tokens from its text:
  exactly with the character tokenizer; with a BPE vocabulary a text may split in more than one way, and a stream
  split otherwise than served may be judged wrong (7 of 828 on an H100 with SmolLM2's). Its control
  (``forced_check_can_fail``): each prompt's reference stream is followed, and every one checked against another
  prompt (the next one answered otherwise: a random model answers some prompts alike) is flagged;
* every refused request gets its 4xx and a message saying why: 409 naming the live id (which, once its request has
  ended, is served again), 400 naming the INT2 pages, a 4xx with a ``detail`` for malformed ones;
* the server process never exits and ``/health`` answers 200 at the end;
* nothing is held: the store of every manager a switch stopped logs (``STORE_RELEASED``, once its loop is over) no
  request, page, window slot or prompt reservation, one line per switch; from Transformers 5.25, where each model
  has a process and a manager of its own that a switch leaves running, each model process logs its store so when
  the server stops it (``STORE_AT_EXIT``).

Reported: p50 / p99 time to first token (streamed requests) and total latency (answered requests of phases 1 and 3),
generated tokens/s and requests/s over those two phases.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import http.client
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVE = ROOT / "scripts" / "serve.py"
sys.path.insert(0, str(ROOT / "tests" / "serving"))  # forced_check, its sibling (a script run with -P has not its
# folder on the path)

# settings of each profile: the server's (OSCAR's window and page pool, Transformers' batching) and the load's
PROFILES = {
    # tokenizer: the CPU profile compares texts exactly (tie_tol 0), where SmolLM2's vocabulary is not ambiguous and
    # tests the server's decoding of multi-byte characters; the GPU profile's token check needs the character one
    "tiny": dict(device="cpu", dtype="float32", tokenizer="smollm2", requests=36, concurrency=4, share=0.6,
                 b_requests=4, distinct=8, min_prompt=20, max_prompt=90, max_new=12, dup_new=48, max_requests=4,
                 page_size=16, num_blocks=48, max_batch_tokens=128, oscar=dict(sink=4, recent=8, group_size=32),
                 tie_tol=0.0, timeout=120.0, deadline=240.0),
    "qwen3-8b": dict(device="cuda", dtype="bfloat16", tokenizer="chars", requests=1000, concurrency=32, share=0.6,
                     b_requests=16, distinct=16, min_prompt=32, max_prompt=1024, max_new=48, dup_new=64,
                     max_requests=32, page_size=256, num_blocks=320, max_batch_tokens=2048,
                     # tie_tol 0.1: the H100 run at 0.05 (serve_load_h100.json) served every token within 0.07 of its
                     # step's best; streams read against another prompt's context were 0.58 or more away
                     oscar=dict(sink=64, recent=256, group_size=64), tie_tol=0.1, timeout=300.0, deadline=240.0),
}
# model B (the switch): another type and shape than A
B_SHAPES = {
    "tiny": dict(model_type="qwen3", hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096),
    "qwen3-8b": dict(model_type="llama", hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                     num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192),
}
# kinds of requests to A in a load phase and their shares (each kind at least once per phase)
KINDS = dict(stream=0.40, plain=0.36, cancel=0.07, abandon=0.04, duplicate=0.04, oversized=0.04, malformed=0.05)
WORDS = ("the quick brown fox jumps over lazy dog while cat sleeps on warm windowsill and children play in garden "
         "until sun goes down behind hills river flows past old mill where miller grinds wheat into flour for bread "
         "baked each morning before town wakes").split()
HELD = ("requests", "pages_used", "window_slots_used", "prompt_bytes", "prompt_tokens_reserved")
# the character tokenizer's vocabulary: printable ASCII and the newline, then EOS (also the padding). No unknown-
# character token and no BOS: a random model emits any id of its vocabulary (its argmax is about uniform over the 97),
# and an id that decodes to no character would make a text ambiguous again (the prompts are mapped to CHARS instead,
# to_alphabet). The EOS's name is not ASCII, so that no ASCII text holds it (every text over CHARS round-trips).
CHARS = "".join(map(chr, range(0x20, 0x7F))) + "\n"
CHAR_EOS = "\u27e8eos\u27e9"  # (⟨eos⟩)


# ------------------------------------------------------------------------------------------------------ models
def load_tokenizer(path: str | None):
    """``"chars"``: :func:`char_tokenizer`; ``None`` or ``"smollm2"``: SmolLM2's, from the packaged GGUF; else a saved
    tokenizer's directory."""
    from transformers import AutoTokenizer

    if path == "chars":
        return char_tokenizer()
    if path and path != "smollm2":
        return AutoTokenizer.from_pretrained(path)
    from oscar_hf.eval.models import SMOLLM2_GGUF, smollm2_dir

    return AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF)


def char_tokenizer():
    """A tokenizer of one token a character of :data:`CHARS`, and :data:`CHAR_EOS` (EOS and padding), built offline:
    a BPE model without merges and without a pre-tokenizer or normalizer (the text is split into its characters as
    is), and a decoder that concatenates. Every id but EOS decodes to one character of its own, so a text has one
    tokenization, ``decode(tok(text).input_ids) == text`` over CHARS, and Transformers' serving streams the text as is
    (its ``DecodeStream`` decodes the ids incrementally: no spaces inserted, no clean-up)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(CHARS)}
    vocab[CHAR_EOS] = len(vocab)
    rust = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # (no unk_token: a character not in CHARS is dropped)
    rust.decoder = decoders.Fuse()
    rust.add_special_tokens([AddedToken(CHAR_EOS, special=True, normalized=False)])
    # clean-up off: it would join " ." and " 's" in the server's non-streamed answer (decode) where the Transformers
    # version applies it (5.25 skips it for a BPE model)
    return PreTrainedTokenizerFast(tokenizer_object=rust, eos_token=CHAR_EOS, pad_token=CHAR_EOS,
                                   clean_up_tokenization_spaces=False)


def is_char_tokenizer(tok) -> bool:
    """Whether ``tok`` is :func:`char_tokenizer`'s (built, or saved and loaded)."""
    return len(tok) == len(CHARS) + 1 and set(tok.get_vocab()) == {*CHARS, CHAR_EOS}


def to_alphabet(tok, text: str) -> str:
    """``text`` in the character tokenizer's alphabet (other whitespace becomes a space, other characters are dropped,
    as the tokenizer would drop them: no id is unknown); unchanged for another tokenizer."""
    if not is_char_tokenizer(tok):
        return text
    return "".join(c if c in CHARS else " " if c.isspace() else "" for c in text)


def build_models(profile: str, p: dict, tok, workdir: Path):
    """``[(path, model)]`` for A and B: random weights (seeded), saved with the tokenizer for the server; the models
    stay here for the references."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if profile == "tiny":
        sys.path.insert(0, str(ROOT / "tests"))  # tiny_models (a script run with -P has no test folder on the path)
        from tiny_models import tiny_config

        a_config = tiny_config("llama", vocab_size=len(tok))
    else:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from bench_generate import SHAPES

        spec = dict(SHAPES[profile], vocab_size=len(tok), max_position_embeddings=8192)
        a_config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    b_spec = dict(B_SHAPES[profile], vocab_size=len(tok))
    b_config = AutoConfig.for_model(b_spec.pop("model_type"), **b_spec)
    out = []
    for name, config, seed in (("A", a_config, 0), ("B", b_config, 1)):
        torch.manual_seed(seed)
        with torch.device(p["device"]):
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, p["dtype"]),
                                                     attn_implementation="sdpa").eval()
        model.generation_config.do_sample = False
        model.generation_config.eos_token_id = tok.eos_token_id
        model.generation_config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        path = workdir / f"model-{name}"
        model.save_pretrained(path)
        tok.save_pretrained(path)
        out.append((str(path), model))
    return out


def make_prompts(tok, rng: random.Random, n: int, lo: int, hi: int) -> list[str]:
    """``n`` texts of ``lo`` to ``hi`` tokens (random words; with the character tokenizer cut to the length drawn, as
    it takes a token a character, not about a token a word)."""
    chars, texts = is_char_tokenizer(tok), []
    for _ in range(n):
        want, words, text = rng.randint(lo, hi), [], ""
        while len(tok(text).input_ids) < want:
            words.extend(rng.choice(WORDS) for _ in range(max(1, (want - len(words)) // 2)))
            text = to_alphabet(tok, " ".join(words))
        texts.append(text[:want] if chars else text)
    return texts


def oversized_prompt(tok, tokens: int) -> str:
    """A text of more than ``tokens`` tokens."""
    text = to_alphabet(tok, " ".join((WORDS * (tokens // len(WORDS) + 1))[: tokens + 1]))  # (a token a word at least)
    if is_char_tokenizer(tok):
        text = text[: tokens + 1]  # (a token a character: the rest would only make the request larger)
    assert len(tok(text).input_ids) > tokens
    return text


def reference(model, tok, text: str, n: int, oscar: dict) -> dict:
    """The greedy run alone through ``OscarCache``: ``n`` tokens at most (to the model's EOS) and, per step, the
    top-2 logit gap over the step's largest |logit|."""
    import torch

    from forced_check import relative_gap
    from oscar_hf import OscarCache
    from oscar_hf.compat import cache_kwargs

    ids = torch.tensor([tok(text).input_ids], device=model.device)
    cache = OscarCache(model, method="hadamard", compile=False, **oscar)
    gc = model.generation_config
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=gc.eos_token_id,
                         pad_token_id=gc.pad_token_id, output_logits=True, return_dict_in_generate=True,
                         **cache_kwargs(model, cache))
    gaps = [relative_gap(logits[0], int(logits[0].topk(2).indices[1])) for logits in out.logits]  # (top-2 gaps)
    return dict(tokens=out.sequences[0, ids.shape[1]:].tolist(), gaps=gaps)


def judge(text: str, count: int | None, ref: dict, m: int, tok, tie_tol: float) -> dict:
    """``exact``, or where the text leaves the reference (``step``, the reference's top-2 ``gap`` there): ``wrong``
    with ``tie_tol`` 0, else ``diverged`` (judged by the teacher-forced check, :func:`follow_diverged`)."""
    want = ref["tokens"][:m]
    full = tok.decode(want, skip_special_tokens=True)
    # (a stream withholds the bytes of a character its last token leaves unfinished, which decode() shows as U+FFFD)
    if text in (full, full.rstrip("\ufffd")) and count in (None, len(want)):
        return dict(verdict="exact")
    k = 0  # the first step the text leaves the reference at (the longest decoded prefix it starts with)
    while k < len(want) and text.startswith(tok.decode(want[: k + 1], skip_special_tokens=True).rstrip("\ufffd")):
        k += 1
    gap = ref["gaps"][k] if k < len(ref["gaps"]) else None
    # (with tie_tol > 0, forced_check.forced_check later turns "diverged" into "followed" or "wrong")
    return dict(verdict="diverged" if tie_tol > 0 else "wrong", step=k, gap=gap, text=text,
                want=full[:200], count=count, want_count=len(want))


# ------------------------------------------------------------------------------------------------------ server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``scripts/serve.py`` as a process (no model pinned), its output collected line by line."""

    def __init__(self, p: dict, port: int):
        o = p["oscar"]
        cmd = [sys.executable, "-P", str(SERVE), "--max-requests", str(p["max_requests"]),
               *(x for k in ("sink", "recent", "group_size") if k in o
                 for x in (f"--{k.replace('_', '-')}", str(o[k]))),
               "--", "--device", p["device"], "--dtype", p["dtype"], "--port", str(port), "--host", "127.0.0.1",
               "--cb-block-size", str(p["page_size"]), "--cb-num-blocks", str(p["num_blocks"]),
               "--cb-max-batch-tokens", str(p["max_batch_tokens"])]
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
        if p["device"] == "cpu":
            env["OMP_NUM_THREADS"] = "1"
        self.port, self.lines = port, []
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            with contextlib.suppress(OSError):
                if get(self.port, "/health")[0] == 200:
                    return
            time.sleep(0.5)
        raise RuntimeError("the server did not start:\n" + "\n".join(self.lines[-60:]))

    def releases(self) -> list[dict]:
        """What each store held when its manager stopped (a switch, up to 5.24) or its model process ended (5.25+,
        where each model has a process and a manager of its own, which a switch does not stop), from the log."""
        from oscar_hf.serving.batching import STORE_RELEASED
        from oscar_hf.serving.engine import STORE_AT_EXIT

        return [json.loads(line.split(mark, 1)[1]) for line in list(self.lines)
                for mark in (STORE_RELEASED, STORE_AT_EXIT) if mark in line]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.reader.join(timeout=10)


def get(port: int, path: str, timeout: float = 10.0) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


def open_post(port: int, body, request_id: str | None, timeout: float):
    """``(connection, response)`` of a POST to ``/v1/completions`` (``body``: a dict, or raw bytes)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"X-Request-ID": request_id} if request_id else {})}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", "/v1/completions", body=data, headers=headers)
    return conn, conn.getresponse()


def read_events(resp, until_text: bool = False):
    """Text, usage and error of a streamed answer, and the time its first text came; ``until_text``: return right
    after the first text."""
    text, usage, error, first = "", None, None, None
    while True:
        line = resp.readline()
        if not line:
            break
        line = line.decode().strip()
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            break
        event = json.loads(payload)
        if "error" in event:
            error = event["error"]
            break
        usage = event.get("usage") or usage
        piece = ((event.get("choices") or [{}])[0].get("text")) or ""
        if piece and first is None:
            first = time.perf_counter()
        text += piece
        if until_text and first is not None:
            break
    return text, usage, error, first


# ------------------------------------------------------------------------------------------------------ load
class Load:
    def __init__(self, p: dict, port: int, tok, models: list, prompts: list[str], refs: list[list[dict]],
                 oversized: str):
        self.p, self.port, self.tok, self.models, self.prompts = p, port, tok, models, prompts
        self.refs, self.oversized, self.ids = refs, oversized, iter(range(10**9))
        self.lock = threading.Lock()

    def body(self, model: int, prompt: int, max_tokens: int, stream: bool) -> dict:
        return dict(model=self.models[model], prompt=self.prompts[prompt], max_tokens=max_tokens, temperature=0.0,
                    stream=stream)

    def rid(self, kind: str) -> str:
        with self.lock:
            return f"load-{kind}-{next(self.ids)}"

    def check(self, model: int, prompt: int, m: int, text: str, count) -> dict:
        return judge(text, count, self.refs[model][prompt], m, self.tok, self.p["tie_tol"])

    def answer(self, model: int, prompt: int, m: int, stream: bool, request_id: str | None = None) -> dict:
        t0 = time.perf_counter()
        conn, resp = open_post(self.port, self.body(model, prompt, m, stream), request_id, self.p["timeout"])
        try:
            if resp.status != 200:
                return dict(status=resp.status, detail=resp.read().decode()[:300], verdict="failed")
            if stream:
                text, usage, error, first = read_events(resp)
            else:
                answer = json.loads(resp.read())
                text, usage, error, first = answer["choices"][0]["text"], answer.get("usage"), None, None
        finally:
            conn.close()
        done = time.perf_counter()
        if error is not None:
            return dict(status=200, detail=str(error)[:300], verdict="failed")
        rec = dict(status=200, total_s=done - t0, ttft_s=(first or done) - t0, streamed=stream,
                   tokens=(usage or {}).get("completion_tokens"), prompt_tokens=(usage or {}).get("prompt_tokens"))
        rec.update(self.check(model, prompt, m, text, rec["tokens"]))
        return rec

    def run(self, job: dict) -> dict:
        kind, model, prompt, m = job["kind"], job["model"], job["prompt"], job["max_tokens"]
        try:
            if kind in ("stream", "plain"):
                return dict(job, **self.answer(model, prompt, m, kind == "stream", self.rid(kind)))
            if kind == "cancel":
                conn, resp = open_post(self.port, self.body(model, prompt, m, True), self.rid(kind), self.p["timeout"])
                with contextlib.closing(conn):
                    if resp.status != 200:
                        return dict(job, status=resp.status, detail=resp.read().decode()[:300], verdict="failed")
                    text = read_events(resp, until_text=True)[0]
                # (closed: the client leaves mid-stream) what came so far starts the reference
                want = self.tok.decode(self.refs[model][prompt]["tokens"][:m], skip_special_tokens=True)
                if want.startswith(text.rstrip("\ufffd")):
                    return dict(job, status=200, verdict="cancelled", text=text)
                return dict(job, status=200, verdict="diverged" if self.p["tie_tol"] > 0 else "wrong", text=text,
                            count=None, cancelled=True)
            if kind == "abandon":  # the client sends a stream and leaves before any answer (mid-prefill, or queued)
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.p["timeout"])
                conn.request("POST", "/v1/completions", body=json.dumps(self.body(model, prompt, m, True)).encode(),
                             headers={"Content-Type": "application/json", "X-Request-ID": self.rid(kind)})
                conn.close()
                return dict(job, status=None, verdict="abandoned")
            if kind == "duplicate":
                rid = self.rid(kind)
                t0 = time.perf_counter()
                conn, resp = open_post(self.port, self.body(model, prompt, m, True), rid, self.p["timeout"])
                with contextlib.closing(conn):
                    if resp.status != 200:
                        return dict(job, status=resp.status, detail=resp.read().decode()[:300], verdict="failed")
                    text, usage, error, first = read_events(resp, until_text=True)
                    c2, r2 = open_post(self.port, self.body(model, prompt, 2, False), rid, self.p["timeout"])
                    with contextlib.closing(c2):
                        again = dict(status=r2.status, detail=r2.read().decode()[:300])
                    rest, usage, error, _ = read_events(resp)
                done = time.perf_counter()
                rec = dict(job, status=200, total_s=done - t0, ttft_s=(first or done) - t0, streamed=True,
                           tokens=(usage or {}).get("completion_tokens"),
                           prompt_tokens=(usage or {}).get("prompt_tokens"), duplicate=again)
                if error is not None:
                    return dict(rec, verdict="failed", detail=str(error)[:300])
                rec.update(self.check(model, prompt, m, text + rest, rec["tokens"]))
                # the id left with its request: taken again, it is served
                rec["reused"] = dict(model=model, prompt=prompt, **self.answer(model, prompt, 2, False, rid))
                return rec
            if kind == "oversized":
                body = dict(self.body(model, prompt, 4, job["stream"]), prompt=self.oversized)
                conn, resp = open_post(self.port, body, self.rid(kind), self.p["timeout"])
                with contextlib.closing(conn):
                    return dict(job, status=resp.status, detail=resp.read().decode()[:300])
            if kind == "malformed":
                body = [b'{"model": "x", "prompt": ', dict(self.body(model, prompt, 4, False), prompt=[1, 2]),
                        dict(self.body(model, prompt, 4, False), no_such_field=1)][job["variant"]]
                conn, resp = open_post(self.port, body, self.rid(kind), self.p["timeout"])
                with contextlib.closing(conn):
                    return dict(job, status=resp.status, detail=resp.read().decode()[:300])
            raise ValueError(f"unknown kind {kind!r}")
        except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
            return dict(job, status=None, verdict="failed", detail=f"{type(e).__name__}: {e}"[:300])

    def phase(self, jobs: list[dict], deadline: float) -> tuple[list[dict], float]:
        """Run ``jobs`` from ``concurrency`` threads; those not started by ``deadline`` (monotonic) are skipped."""
        def bounded(job):
            if time.monotonic() > deadline:
                return dict(job, verdict="not_run")
            return self.run(job)

        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(self.p["concurrency"]) as pool:
            out = list(pool.map(bounded, jobs))
        return out, time.perf_counter() - t0


def follow_diverged(records: list[dict], models, prompts: list[str], refs, tok, p: dict) -> dict:
    """Judge every ``diverged`` stream by teacher forcing (``forced_check``, tolerance ``tie_tol``), in place: its
    verdict becomes ``followed`` or ``wrong``. Returns the check's control on model A: each prompt's own reference
    stream must be followed, and every stream checked against another prompt (the next one whose reference differs
    from it) flagged."""
    from forced_check import forced_check

    tol = p["tie_tol"] if p["tie_tol"] > 0 else 1e-3
    answers = records + [r["reused"] for r in records if isinstance(r.get("reused"), dict)]  # (a duplicate's reuse)
    for m, model in enumerate(models):
        todo = [r for r in answers if r.get("verdict") == "diverged" and r["model"] == m]
        if todo:
            got = forced_check(model, tok, [prompts[r["prompt"]] for r in todo], [r["text"] for r in todo],
                               [r.get("count") for r in todo], p["oscar"], tol)
            for r, g in zip(todo, got):
                # (a cancelled stream that left the reference has no step or gap)
                r.update(left_reference_at=dict(step=r.get("step"), gap=r.get("gap")), **g)
    mine = sorted(refs[0])
    texts = [tok.decode(refs[0][i]["tokens"], skip_special_tokens=True) for i in mine]
    counts = [len(refs[0][i]["tokens"]) for i in mine]
    # each stream against the next prompt whose reference differs from it where both have tokens: a random model can
    # answer two prompts alike (with a vocabulary of characters, both "cccc..."), and a stream that is the other
    # prompt's own is right to follow it
    def differs(i: int, j: int) -> bool:
        a, b = refs[0][i]["tokens"], refs[0][j]["tokens"]
        return a[: len(b)] != b[: len(a)]

    pairs = [(n, next((j for j in mine[n + 1:] + mine[:n] if differs(i, j)), None)) for n, i in enumerate(mine)]
    pairs = [(n, j) for n, j in pairs if j is not None]  # (none only where every prompt's reference is alike)
    own = forced_check(models[0], tok, [prompts[i] for i in mine], texts, counts, p["oscar"], tol)
    other = forced_check(models[0], tok, [prompts[j] for _, j in pairs], [texts[n] for n, _ in pairs],
                         [counts[n] for n, _ in pairs], p["oscar"], tol)
    return dict(ok=len(other) > 1 and all(g["verdict"] == "followed" for g in own)
                and all(g["verdict"] == "wrong" for g in other),
                own_max_gap=max(g["max_gap"] for g in own), tol=tol,
                others_flagged=sum(g["verdict"] == "wrong" for g in other), others=len(other),
                # prompts checked against a later one than the next, whose reference was the same as theirs
                others_past_alike=sum(j != mine[(n + 1) % len(mine)] for n, j in pairs),
                others_flagged_at=[g["step"] for g in other],
                # how far the flagged streams were from their step's best (at least): the margin over own_max_gap
                # that a tolerance has between rounding and a stream read against another context
                others_min_gap=min((g["gap"] if g["gap"] is not None else g["lost_gap"] or 0.0 for g in other
                                    if g["verdict"] == "wrong"), default=None))


def plan(p: dict, rng: random.Random, n: int, model: int, kinds: dict) -> list[dict]:
    """``n`` jobs for ``model``: each kind of ``kinds`` at least once, the rest drawn by their shares, shuffled."""
    names = list(kinds)
    drawn = names[:n] + rng.choices(names, weights=[kinds[k] for k in names], k=max(0, n - len(names)))
    rng.shuffle(drawn)
    jobs = []
    for i, kind in enumerate(drawn):
        prompt = rng.randrange(4) if kind == "duplicate" else rng.randrange(p["distinct"])
        m = p["dup_new"] if kind == "duplicate" else rng.randint(1, p["max_new"])
        jobs.append(dict(kind=kind, model=model, prompt=prompt, max_tokens=m, variant=i % 3, stream=bool(i % 2)))
    return jobs


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    v = sorted(values)
    at = lambda q: v[min(len(v) - 1, int(round(q * (len(v) - 1))))]  # noqa: E731
    return dict(p01=round(at(0.01), 4), p50=round(at(0.5), 4), p99=round(at(0.99), 4), max=round(v[-1], 4),
                n=len(v))


def summarize(records: list[dict], tie_tol: float) -> tuple[dict, dict]:
    """Counts by kind and verdict, and the checks (``{name: {"ok": bool, ...}}``)."""
    by = {}
    for r in records:
        key = f"{r['kind']}:{r.get('verdict', r.get('status'))}"
        by[key] = by.get(key, 0) + 1
    answered = [r for r in records if r["kind"] in ("stream", "plain", "duplicate")]
    wrong = [r for r in records if r.get("verdict") == "wrong"]
    failed = [r for r in records if r.get("verdict") in ("failed", "not_run")]
    ran = [r for r in records if r.get("verdict") != "not_run"]  # (skipped by the deadline: judged as failed below)
    refused_ok = {
        "duplicate": all(r.get("duplicate", {}).get("status") == 409 and "already live" in r["duplicate"]["detail"]
                         and r["reused"].get("verdict") in ("exact", "followed" if tie_tol > 0 else "exact")
                         for r in ran if r["kind"] == "duplicate" and r.get("verdict") != "failed"),
        "oversized": all(r["status"] == 400 and "INT2 pages" in r["detail"]
                         for r in ran if r["kind"] == "oversized"),
        "malformed": all(r["status"] is not None and 400 <= r["status"] < 500 and ("detail" in r["detail"]
                                                                                   or "error" in r["detail"])
                         for r in ran if r["kind"] == "malformed"),
    }
    checks = dict(
        no_wrong_stream=dict(ok=not wrong, wrong=wrong[:5]),
        every_request_answered=dict(ok=not failed, failed=failed[:5]),
        exact_unless_followed=dict(ok=all(r.get("verdict") in ("exact", "followed" if tie_tol > 0 else "exact")
                                     for r in answered if r.get("verdict") not in ("failed", "not_run"))),
        refusals=dict(ok=all(refused_ok.values()), **refused_ok,
                      examples={k: next((r.get("duplicate", r)["detail"] for r in ran if r["kind"] == k), None)
                                for k in refused_ok}),
    )
    return by, checks


def run(profile: str, workdir: Path, tokenizer: str | None = None, seed: int = 0, **overrides) -> dict:
    """The whole load test (see the module docstring); returns the result (``ok``, ``checks``, figures)."""
    import torch
    import transformers

    if PROFILES[profile]["device"] == "cpu":
        torch.set_num_threads(1)  # (the server computes beside us: tiny matmuls gain nothing from a second thread)
    p = {**PROFILES[profile], **{k: v for k, v in overrides.items() if v is not None}}
    p["tokenizer"] = tokenizer or p["tokenizer"]
    from oscar_hf.serving.engine import _engine_client

    engine_processes = _engine_client()  # 5.25+: each model runs in a process of its own
    rng = random.Random(seed)
    tok = load_tokenizer(p["tokenizer"])
    times, t0 = {}, time.perf_counter()
    (a_path, a_model), (b_path, b_model) = build_models(profile, p, tok, workdir)
    times["models_s"] = time.perf_counter() - t0
    prompts = make_prompts(tok, rng, p["distinct"], p["min_prompt"], p["max_prompt"])
    pool_tokens = p["num_blocks"] * p["page_size"] + p["oscar"].get("sink", 64) + p["oscar"].get("recent", 256)
    oversized = oversized_prompt(tok, pool_tokens + 64)
    n_a = p["requests"] - p["b_requests"] - 2  # (and a warm-up request and a last one)
    n1 = int(n_a * p["share"])
    warm = dict(kind="plain", model=0, prompt=0, max_tokens=2)
    last = dict(kind="plain", model=1, prompt=1, max_tokens=2)
    phases = [plan(p, rng, n1, 0, KINDS), plan(p, rng, p["b_requests"], 1, dict(stream=1, plain=1)),
              plan(p, rng, n_a - n1, 0, KINDS)]
    need = {}  # (model, prompt): the most tokens a request of the plan checks
    for job in [warm, last, *(j for jobs in phases for j in jobs)]:
        key = (job["model"], job["prompt"])
        need[key] = max(need.get(key, 0), job["max_tokens"])
    server = Server(p, free_port())  # (starts while the references are computed)
    try:
        t1 = time.perf_counter()
        models = (a_model, b_model)
        refs = [{i: reference(models[m], tok, prompts[i], n, p["oscar"]) for (m, i), n in need.items() if m == k}
                for k in range(2)]
        times["references_s"] = time.perf_counter() - t1
        server.wait_ready(p["timeout"] * 2)
        times["until_ready_s"] = time.perf_counter() - t0
        load = Load(p, server.port, tok, [a_path, b_path], prompts, refs, oversized)
        warm = load.run(warm)  # loads A
        deadline = time.monotonic() + p["deadline"]
        one, one_s = load.phase(phases[0], deadline)
        two, _ = load.phase(phases[1], deadline)
        three, three_s = load.phase(phases[2], deadline)
        last = load.run(last)  # stops A's manager after its load (up to 5.24)
        times["until_load_done_s"] = time.perf_counter() - t0
        # three switches stop three managers up to 5.24 (one stopped mid-flush releases once its loop is over); from
        # 5.25 the two model processes log their stores when the server stops them, below
        wait = time.monotonic() + 60
        while engine_processes is None and len(server.releases()) < 3 and time.monotonic() < wait:
            time.sleep(0.2)
        times["until_released_s"] = time.perf_counter() - t0
        health = get(server.port, "/health")
        alive = server.proc.poll() is None
    finally:
        server.stop()
    times["total_s"] = time.perf_counter() - t0
    records = [dict(r, phase=i) for i, rs in ((1, one), (2, two), (3, three)) for r in rs]
    records += [dict(warm, phase=0), dict(last, phase=4)]
    t2 = time.perf_counter()
    control = follow_diverged(records, models, prompts, refs, tok, p)
    times["forced_check_s"] = time.perf_counter() - t2
    by, checks = summarize(records, p["tie_tol"])
    checks["forced_check_can_fail"] = control
    releases = server.releases()
    checks["server_never_stopped"] = dict(ok=alive and health[0] == 200, health=health)
    expected = 3 if engine_processes is None else 2
    checks["nothing_held"] = dict(ok=len(releases) >= expected and all(not r.get(k) for r in releases for k in HELD),
                                  expected=expected, releases=releases)
    # (the load phases' records: their verdicts after the forced check, which updates ``records``, not ``one``; a
    # stream the client closed after its first text has no latency, though the check may find it followed)
    loaded = [r for r in records if r["phase"] in (1, 3) and r.get("verdict") in ("exact", "followed")
              and "total_s" in r]
    tokens = sum(r.get("tokens") or 0 for r in loaded)
    streamed = [r["ttft_s"] for r in loaded if r.get("streamed")]
    res = dict(
        profile=profile, settings=p, vocab_size=len(tok), seed=seed, requests=len(records),
        times={k: round(v, 1) for k, v in times.items()},
        device=torch.cuda.get_device_name() if p["device"] == "cuda" else platform.processor() or "cpu",
        torch=torch.__version__, transformers=transformers.__version__, counts=by,
        exact=sum(r.get("verdict") == "exact" for r in records),
        followed=sum(r.get("verdict") == "followed" for r in records),
        forced_max_gap=percentiles([r["max_gap"] for r in records if "max_gap" in r]),
        wrong=sum(r.get("verdict") == "wrong" for r in records),
        wrong_at=[{k: r.get(k) for k in ("kind", "prompt", "max_tokens", "step", "gap", "lost")} for r in records
                  if r.get("verdict") == "wrong"],
        # how strict --tie-tol is: the references' own top-2 gaps (over the step's largest |logit|)
        reference_gaps=percentiles([g for model in refs for ref in model.values() for g in ref["gaps"]]),
        load_s=round(one_s + three_s, 2), ttft_s=percentiles(streamed),
        latency_s=percentiles([r["total_s"] for r in loaded]),
        tokens_per_s=round(tokens / (one_s + three_s), 1),
        prompt_tokens_per_s=round(sum(r.get("prompt_tokens") or 0 for r in loaded) / (one_s + three_s), 1),
        requests_per_s=round(len(one + three) / (one_s + three_s), 2),
        generated_tokens=tokens, checks=checks, server_log_tail=server.lines[-40:])
    res["ok"] = all(c["ok"] for c in checks.values())
    res["failed"] = [k for k, c in checks.items() if not c["ok"]]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="tiny", choices=sorted(PROFILES))
    ap.add_argument("--tokenizer", help="chars (a token a character), smollm2 (SmolLM2's, from the packaged GGUF) or "
                    "a saved tokenizer's directory (default: the profile's, chars on the GPU, smollm2 on the CPU)")
    ap.add_argument("--requests", type=int)
    ap.add_argument("--concurrency", type=int)
    ap.add_argument("--deadline", type=float, help="seconds of load after which no request starts")
    ap.add_argument("--tie-tol", type=float)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], help="the models' (and the server's) dtype")
    ap.add_argument("--num-blocks", type=int, help="the page pool's pages (a small pool makes Transformers soft-reset)")
    ap.add_argument("--max-requests", type=int, help="window slots: requests live at once")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", help="where the models are saved (default: a temporary directory)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=a.workdir) as tmp:
        res = run(a.profile, Path(tmp), a.tokenizer, a.seed, requests=a.requests, concurrency=a.concurrency,
                  deadline=a.deadline, tie_tol=a.tie_tol, dtype=a.dtype, num_blocks=a.num_blocks,
                  max_requests=a.max_requests)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1, default=str))
    summary = {k: res[k] for k in ("ok", "failed", "requests", "exact", "followed", "wrong", "counts", "ttft_s",
                                    "latency_s", "forced_max_gap",
                                    "tokens_per_s", "prompt_tokens_per_s", "requests_per_s", "reference_gaps")}
    print(json.dumps(summary, indent=1))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
