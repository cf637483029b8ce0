"""One bad request fails alone: requests the OSCAR store cannot serve are refused at submission (duplicate live ids,
prompts that can never fit the page pool, forks, empty prompts, ids outside the vocabulary), the manager keeps
serving, and every other request gets exactly the tokens it gets alone through ``OscarCache``."""
import contextlib
import time

import pytest
import torch
from transformers import GenerationConfig

from oscar_hf import OscarCache
from oscar_hf.compat import cache_kwargs
from oscar_hf.serving import continuous_batching_config, paged_oscar
from oscar_hf.serving.admission import RequestRefused

OSCAR = dict(sink=4, recent=8, group_size=32)
PAGES, PAGE = 16, 8  # the pool: 16 pages of 8 tokens, a request holds at most 4 + 8 + 128 tokens


def gen_config(n: int = 6, **kw) -> GenerationConfig:
    return GenerationConfig(**{**dict(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0), **kw})


def cb_config():
    return continuous_batching_config(num_blocks=PAGES, max_batch_tokens=256, page_size=PAGE)


@contextlib.contextmanager
def serving(model, generation_config=None, start=True, **store_kw):
    """A manager of ``model`` inside ``paged_oscar`` (yields it and the store), stopped on exit."""
    with paged_oscar(model, **{**OSCAR, **store_kw}) as store:
        manager = model.init_continuous_batching(generation_config=generation_config or gen_config(),
                                                 continuous_batching_config=cb_config())
        if start:
            manager.start()
        try:
            yield manager, store
        finally:
            manager.stop(block=True)


def alone(model, prompt, n):
    cache = OscarCache(model, method="hadamard", compile=False, **OSCAR)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0, **cache_kwargs(model, cache))
    return out[0, len(prompt):].tolist()


def result(manager, rid, timeout=300.0):  # (a hang guard: SmolLM2's shared-prefix run took 70-126 s on a busy CPU)
    deadline = time.time() + timeout
    while time.time() < deadline:
        r = manager.get_result(rid, timeout=1)
        if r is not None and r.is_finished():
            return r
    raise AssertionError(f"no result for {rid!r}")


def test_bad_requests_are_refused_at_submission_and_the_rest_keep_their_tokens(model):
    good = list(range(5, 40))
    # (computed before the manager runs: while it does, the model's attention is the manager's)
    want, want_again = alone(model, good, 30), alone(model, list(range(5, 20)), 3)
    with paged_oscar(model, **OSCAR) as store:
        manager = model.init_continuous_batching(generation_config=gen_config(),
                                                 continuous_batching_config=cb_config())
        manager.start()
        try:
            manager.add_request(good, request_id="x", max_new_tokens=30)
            refused = {}
            for name, kw in dict(
                duplicate=dict(input_ids=list(range(5, 20)), request_id="x", max_new_tokens=3),
                too_long=dict(input_ids=list(range(5, 200)), request_id="y", max_new_tokens=3),
                empty=dict(input_ids=[], request_id="z"),
                vocabulary=dict(input_ids=[3, model.config.vocab_size], request_id="w"),
            ).items():
                with pytest.raises(RequestRefused) as e:
                    manager.add_request(**kw)
                refused[name] = e.value
            assert refused["duplicate"].status_code == 409 and "'x' is already live" in str(refused["duplicate"])
            assert refused["too_long"].status_code == 400 and "INT2 pages" in str(refused["too_long"])
            assert "empty" in str(refused["empty"]) and "vocabulary" in str(refused["vocabulary"])
            assert isinstance(refused["too_long"], ValueError)
            r = result(manager, "x")
            assert r.error is None and r.generated_tokens == want
            # the id left with its request: it is taken again, and served
            manager.add_request(list(range(5, 20)), request_id="x", max_new_tokens=3)
            assert result(manager, "x").generated_tokens == want_again
            assert manager.background_thread_status.fatal_error is None
        finally:
            manager.stop(block=True)
        assert not store.requests


def test_the_pool_limit_is_exact(model):
    """The longest request the pool holds is served (to its last token); one token more is refused."""
    from oscar_hf.serving import SECTOR_API

    # stored tokens = prompt + max_new_tokens - 1; a request holds 4 + 8 + 16 * 8 = 140 (5.20+: its history pages),
    # 16 * 8 = 128 on 5.17 - 5.19 (Transformers' blocks count every token there)
    prompt = list(range(3, 103))
    most = 41 if SECTOR_API else 29
    with serving(model) as (manager, store):
        with pytest.raises(RequestRefused):
            manager.add_request(prompt, request_id="over", max_new_tokens=most + 1)
        manager.add_request(prompt, request_id="fits", max_new_tokens=most)
        r = result(manager, "fits")
        assert r.error is None and len(r.generated_tokens) == most
        assert not SECTOR_API or store.pool.peak_used == PAGES
        assert manager.background_thread_status.fatal_error is None


def test_requests_sent_before_the_cache_exists_fail_alone_in_the_loop(model):
    """A manager not started yet has no pool to check against: the loop checks each request as it joins the
    scheduler and fails it alone (its error says why); the others are served."""
    good = list(range(7, 30))
    want = alone(model, good, 5)
    with serving(model, start=False) as (manager, _):
        manager.add_request(list(range(5, 200)), request_id="big", max_new_tokens=3)
        manager.add_request(good, request_id="ok", max_new_tokens=5)
        manager.start()
        got = {rid: result(manager, rid) for rid in ("big", "ok")}
        assert "INT2 pages" in got["big"].error
        assert got["ok"].error is None and got["ok"].generated_tokens == want
        assert manager.background_thread_status.fatal_error is None


def test_a_cancelled_id_is_free_again(model):
    want = alone(model, list(range(9, 30)), 4)
    with serving(model) as (manager, _):
        manager.add_request(list(range(5, 40)), request_id="c", max_new_tokens=60)
        manager.cancel_request("c")
        deadline = time.time() + 60
        while True:  # live until the loop has cleared the cancellation, then free
            try:
                manager.add_request(list(range(9, 30)), request_id="c", max_new_tokens=4)
                break
            except RequestRefused:
                assert time.time() < deadline, "the cancelled id never left"
                time.sleep(0.05)
        assert result(manager, "c").generated_tokens == want


def test_forks_are_refused_where_the_cache_cannot_fork(model):
    """Forks (``num_return_sequences > 1``) are served where the store holds every layer (tests/serving/test_prefix.py);
    refused at submission where a layer stays in Transformers' BF16 cache (``skip_layers``)."""
    with serving(model, gen_config(num_return_sequences=2, do_sample=True), skip_layers=(0,), num_pages=PAGES,
                 page_size=PAGE) as (manager, _):
        with pytest.raises(RequestRefused, match="fork"):
            manager.add_request([1, 2, 3], request_id="f")
        assert manager.background_thread_status.fatal_error is None


def test_refusal_without_the_serving_extra():
    """Without Starlette (no ``transformers[serving]``) the refusal is a plain ValueError and the module imports: an
    HTTP base that falls back to ``Exception`` before ``ValueError`` has no method resolution order."""
    import subprocess
    import sys

    probe = ("import sys; sys.modules['starlette'] = sys.modules['starlette.exceptions'] = None\n"
             "from oscar_hf.serving.admission import RequestRefused\n"
             "e = RequestRefused('a live id', 409)\n"
             "assert isinstance(e, ValueError) and e.status_code == 409 and str(e) == 'a live id'\n")
    res = subprocess.run([sys.executable, "-P", "-c", probe], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
