"""``scripts/serve.py``: ``transformers serve --continuous-batching`` with OSCAR's paged cache, started as a process on
localhost (a tiny random Llama with SmolLM2's tokenizer, CPU), answering an OpenAI-style completion with the tokens
its run alone through ``OscarCache`` gives."""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from oscar_hf import OscarCache
from oscar_hf.compat import cache_kwargs
from oscar_hf.eval.models import SMOLLM2_GGUF, smollm2_dir

from tiny_models import tiny_model

pytest.importorskip("fastapi", reason="transformers serve needs `pip install transformers[serving]`")
pytest.importorskip("uvicorn", reason="transformers serve needs `pip install transformers[serving]`")

ROOT = Path(__file__).resolve().parents[2]
OSCAR = dict(sink=4, recent=8, group_size=32)
PROMPT = ("The quick brown fox jumps over the lazy dog while the cat sleeps on the warm windowsill, and the "
          "children play in the garden until the sun goes down behind the hills.")
NEW_TOKENS = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF)
    model = tiny_model("llama", vocab_size=len(tok))
    model.generation_config.do_sample = False
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, model, tok


def start(cmd):
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)


def stop(server) -> str:
    server.terminate()
    try:
        return server.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        server.kill()
        return server.communicate()[0]


@pytest.fixture(scope="module")
def server(model_dir):
    """``scripts/serve.py`` on a free localhost port: ``(base url, the process)``; its log is printed at the end."""
    path, _, _ = model_dir
    port = free_port()
    cmd = [sys.executable, "-P", str(ROOT / "scripts" / "serve.py"), str(path), "--max-requests", "4",
           "--sink", str(OSCAR["sink"]), "--recent", str(OSCAR["recent"]), "--group-size", str(OSCAR["group_size"]),
           "--", "--device", "cpu", "--dtype", "float32", "--port", str(port), "--cb-num-blocks", "64",
           "--cb-max-batch-tokens", "256"]
    proc = start(cmd)
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://localhost:{port}/v1/models", timeout=2)
                break
            except urllib.error.HTTPError:  # it answered (5.17 lists models by scanning the Hub cache: 500 here)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise AssertionError(f"the server did not start:\n{proc.stdout.read()[-3000:]}")
                time.sleep(0.5)
        yield f"http://localhost:{port}", proc
    finally:
        print(stop(proc)[-3000:])


def oscar_alone(model, tok, prompt: str, n: int) -> str:
    ids = tok(prompt, return_tensors="pt").input_ids
    kw = dict(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = model.generate(ids, **kw, **cache_kwargs(model, OscarCache(model, method="hadamard", compile=False,
                                                                     **OSCAR)))
    return tok.decode(out[0, ids.shape[1]:])


def test_serve_launcher_answers_through_oscar(model_dir, server):
    path, model, tok = model_dir
    url, _ = server
    answer = post(f"{url}/v1/completions", dict(model=str(path), prompt=PROMPT, max_tokens=NEW_TOKENS,
                                                 temperature=0.0))
    text = answer["choices"][0]["text"]
    ids = tok(PROMPT, return_tensors="pt").input_ids
    assert ids.shape[1] > OSCAR["sink"] + OSCAR["recent"] + 8  # the prompt reaches the INT2 history
    want = oscar_alone(model, tok, PROMPT, NEW_TOKENS)
    assert text == want, f"server said {text!r}, OscarCache alone {want!r}"
    kw = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert tok.decode(model.generate(ids, **kw)[0, ids.shape[1]:]) != want  # OSCAR changes the greedy tokens


def request(url: str, body: dict, request_id: str | None = None):
    headers = {"Content-Type": "application/json", **({"X-Request-ID": request_id} if request_id else {})}
    return urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)


def status_of(req) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_bad_requests_get_a_4xx_and_the_server_keeps_serving(model_dir, server):
    """While a streamed request decodes: the same X-Request-ID again (a retry) gets 409, streamed or not (on every
    supported Transformers: 5.25+ hands the model process ids of its own, the serving process refuses it); a request
    that can never fit the page pool 400, streamed or not, completion or chat; a malformed one 400 (Transformers' own check). The first stream's text is
    then exactly its run alone through OscarCache, the worker is healthy and serves the next request."""
    path, model, tok = model_dir
    url, _ = server
    long = 120
    body = dict(model=str(path), prompt=PROMPT, max_tokens=long, temperature=0.0)
    stream = urllib.request.urlopen(request(f"{url}/v1/completions", {**body, "stream": True}, "dup"), timeout=120)
    chunks = []
    first = stream.readline()  # the request is live once its first chunk is out
    assert first.startswith(b"data:")
    chunks.append(first)
    codes = {
        "duplicate": status_of(request(f"{url}/v1/completions", {**body, "max_tokens": 4}, "dup")),
        "duplicate streamed": status_of(request(f"{url}/v1/completions", {**body, "stream": True}, "dup")),
        "too long": status_of(request(f"{url}/v1/completions", {**body, "max_tokens": 64 * 256}, "big")),
        # streamed: refused before the stream starts (5.25+'s model process refuses it after the handler returned)
        "too long streamed": status_of(request(f"{url}/v1/completions",
                                               {**body, "max_tokens": 64 * 256, "stream": True}, "big-s")),
        "too long streamed chat": status_of(request(
            f"{url}/v1/chat/completions", dict(model=str(path), messages=[dict(role="user", content=PROMPT)],
                                               max_tokens=64 * 256, temperature=0.0, stream=True), "big-c")),
        "malformed": status_of(request(f"{url}/v1/completions", {**body, "prompt": [1, 2]}, "bad")),
    }
    chunks.extend(stream.readlines())
    stream.close()
    # (5.17 - 5.24: the manager's admission refuses it; 5.25+, whose model process numbers requests itself: the
    # serving process's request-id middleware)
    assert codes["duplicate"][0] == 409 and "already live" in codes["duplicate"][1], codes
    assert codes["duplicate streamed"][0] == 409 and "already live" in codes["duplicate streamed"][1], codes
    for kind in ("too long", "too long streamed", "too long streamed chat"):
        assert codes[kind][0] == 400 and "INT2 pages" in codes[kind][1], (kind, codes)
    assert codes["malformed"][0] == 400, codes
    text = ""
    for line in b"".join(chunks).decode().splitlines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            choices = json.loads(line[5:]).get("choices") or [{}]
            text += choices[0].get("text") or ""
    assert text == oscar_alone(model, tok, PROMPT, long)
    assert status_of(urllib.request.Request(f"{url}/health"))[0] == 200
    again = post(f"{url}/v1/completions", dict(model=str(path), prompt=PROMPT, max_tokens=NEW_TOKENS,
                                                temperature=0.0))
    assert again["choices"][0]["text"] == oscar_alone(model, tok, PROMPT, NEW_TOKENS)


def test_an_artifact_that_does_not_fit_stops_the_launcher_before_the_port_opens(model_dir, tmp_path):
    from oscar_hf import OscarRotations

    path, _, _ = model_dir
    other = tiny_model("llama", num_hidden_layers=3, vocab_size=300)  # another shape
    OscarRotations.builtin(other.config, "hadamard").save_pretrained(tmp_path / "rotations")
    port = free_port()
    proc = start([sys.executable, "-P", str(ROOT / "scripts" / "serve.py"), str(path), "--rotations",
                  str(tmp_path / "rotations"), "--", "--device", "cpu", "--port", str(port)])
    try:
        log = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            stop(proc)
    assert proc.returncode != 0
    assert "OSCAR cannot serve" in log and "do not fit" in log, log[-2000:]
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://localhost:{port}/health", timeout=2)
