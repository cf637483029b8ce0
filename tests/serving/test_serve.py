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
from oscar_hf.models import SMOLLM2_GGUF, smollm2_dir, tiny_model

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


def test_serve_launcher_answers_through_oscar(model_dir):
    path, model, tok = model_dir
    port = free_port()
    cmd = [sys.executable, "-P", str(ROOT / "scripts" / "serve.py"), str(path), "--max-requests", "4",
           "--sink", str(OSCAR["sink"]), "--recent", str(OSCAR["recent"]), "--group-size", str(OSCAR["group_size"]),
           "--", "--device", "cpu", "--dtype", "float32", "--port", str(port), "--cb-num-blocks", "64",
           "--cb-max-batch-tokens", "256"]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://localhost:{port}/v1/models", timeout=2)
                break
            except urllib.error.HTTPError:  # it answered (5.17 lists models by scanning the Hub cache: 500 here)
                break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    raise AssertionError(f"the server did not start:\n{server.stdout.read()[-3000:]}")
                time.sleep(0.5)
        answer = post(f"http://localhost:{port}/v1/completions",
                      dict(model=str(path), prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0.0))
    finally:
        server.terminate()
        try:
            log = server.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            server.kill()
            log = server.communicate()[0]
    text = answer["choices"][0]["text"]
    ids = tok(PROMPT, return_tensors="pt").input_ids
    assert ids.shape[1] > OSCAR["sink"] + OSCAR["recent"] + 8  # the prompt reaches the INT2 history
    kw = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    alone = model.generate(ids, **kw, **cache_kwargs(model, OscarCache(model, method="hadamard", compile=False,
                                                                       **OSCAR)))
    bf16 = model.generate(ids, **kw)
    want = tok.decode(alone[0, ids.shape[1]:])
    assert text == want, f"server said {text!r}, OscarCache alone {want!r}\n{log[-2000:]}"
    assert not torch.equal(alone, bf16)  # OSCAR changes this model's greedy tokens: the server did run it
