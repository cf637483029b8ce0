"""OSCAR's serving decode step under CUDA graphs: the host side of a step (decode plan, pages, lengths) runs in the
prepare hook and fills fixed buffers; the forward is device work only, so Transformers' graphs may capture and
replay it. On the CPU the graphs are emulated (``graph_emulation.py``: a capture records the aten ops and undoes
their writes, a replay re-runs them on the same tensors with no Python), which also forbids host synchronizations
inside a capture."""
import random

import pytest
import torch
from graph_emulation import EmulatedGraph, HostSync, NoHostSync, emulate_cuda_graphs
from test_store import HEADS, FakeAttention, make_store
from transformers import GenerationConfig

from oscar_hf import OscarCache
from oscar_hf.compat import cache_kwargs
from oscar_hf.kernels.decode import decode
from oscar_hf.kernels.kv import History, KVParams, Pages, Window

from oscar_hf.serving import continuous_batching_config, paged_oscar

OSCAR = dict(sink=4, recent=8, group_size=32)
NEW_TOKENS = 24


def served(model, prompts, graphs: bool, q_pad: int = 4, **store_kw):
    """``(tokens per request, [(rows, decode rows, graphable, history bound)] per planned step)`` of one
    ``generate_batch``. Graphed: the KV read padded to pages (8 tokens), so Transformers' own key changes as the
    requests grow (5.17 - 5.19 count every request's cached tokens in it)."""
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    extra = dict(use_cuda_graph=True, q_padding_interval_size=q_pad, kv_padding_interval_size=8) if graphs else \
        dict(use_cuda_graph=False)
    cb = continuous_batching_config(num_blocks=128, max_batch_tokens=256, page_size=8, max_requests_per_batch=3,
                                    **extra)
    steps = []
    with paged_oscar(model, **{**OSCAR, **store_kw}) as store:
        plan = store.plan_decode

        def record(batch, rows=None):
            out = plan(batch, rows)
            if out is not None:
                steps.append((out.write.pos.shape[0], len(out.requests), out.graphable, out.pages.max_len))
            return out

        store.plan_decode = record
        out = model.generate_batch(prompts, gen, continuous_batching_config=cb, warmup=False)
        assert store.pool.num_used == 0 and not store.requests
    return [r.generated_tokens for r in out.values()], steps


def alone(model, prompt, **store_kw):
    kw = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    kw.update(cache_kwargs(model, OscarCache(model, method="hadamard", compile=False, **{**OSCAR, **store_kw})))
    return model.generate(torch.tensor([prompt]), **kw)[0, len(prompt):].tolist()


@pytest.mark.parametrize("store_kw", [{}, dict(retrieval_heads=((0, 1), (1, 0)), retrieval_bits=8),
                                      dict(group_size=16, key_bits=3, value_group_size=32)],
                         ids=["int2", "retrieval-heads", "k3-own-value-group"])
def test_generate_batch_with_cuda_graphs_equals_eager_and_generate(model, monkeypatch, store_kw):
    from oscar_hf.serving.batching import OscarPagedCache

    if getattr(OscarPagedCache, "updates_in_attention", False):  # 5.20 - 5.23: refused, test_graphs_refused_...
        pytest.skip("CUDA graphs with OSCAR need Transformers 5.24+")
    """(a) tokens with graphed decode steps equal the eager serving path and OscarCache alone; (b) no capture
    synchronized with the host (the emulated capture raises on it); (c) graphs were captured once per (padded rows,
    history bound) and replayed for later steps, whose plans only rewrote the buffers -- not again as Transformers'
    KV read grows, which the store's forward does not read; padded rows (3 requests a step at most, padded to 4) ran
    in them."""
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 256) for _ in range(n)] for n in (3, 10, 17, 40, 25, 6, 33, 12)]
    eager, eager_steps = served(model, prompts, graphs=False, **store_kw)
    log = emulate_cuda_graphs(monkeypatch)
    graphed, steps = served(model, prompts, graphs=True, **store_kw)
    captures = sum(e == "capture" for e, _ in log)
    replays = sum(e == "replay" for e, _ in log)
    assert captures >= 2 and replays > 3 * captures  # several (rows, bound) keys, most steps replayed
    assert captures == len({(rows, bound) for rows, _, g, bound in steps if g})  # one capture a key, no more
    assert any(g and rows > n for rows, n, g, _ in steps)  # padded rows in graphed steps
    assert not any(g for _, _, g, _ in eager_steps) and all(rows == n for rows, n, _, _ in eager_steps)
    assert graphed == eager
    assert graphed == [alone(model, p, **store_kw) for p in prompts]


def test_the_capture_check_catches_host_syncs():
    """The checks bite: ``.tolist()`` / ``.item()`` / a data-dependent shape raise, and so does the paged read
    without a host bound on the history (the per-row reference reads the lengths on the host)."""
    for fn in (lambda t: t.tolist(), lambda t: t.sum().item(), lambda t: t.nonzero(), lambda t: bool(t.any())):
        with pytest.raises(HostSync), NoHostSync():
            fn(torch.arange(3))
    cfg, store = prefilled_store()
    plan = store.plan_decode(BATCH)
    li, p = store.layer_slot[0], store.params[0]
    q = torch.randn(plan.write.pos.shape[0], store.num_kv_heads, 2, cfg.head_dim)
    params = KVParams(p.r_k, p.mu_k, p.r_v, p.mu_v, 32)
    window = Window(store.windows.k[:, li], store.windows.v[:, li], plan.win_mask[:, None, None, :], plan.write.slots)

    def read(bound):
        history = History(store.pool.rows(li, "k"), store.pool.rows(li, "v"),
                          pages=Pages(plan.pages.table, plan.pages.lengths, bound))
        return decode(params, q, window, history, 0.1, torch.float32)

    with pytest.raises(HostSync), NoHostSync():
        read(None)
    with NoHostSync():
        read(plan.pages.max_len)


# ---------------------------------------------------------------------------------------------- store level
PROMPTS = {"a": 30, "b": 13, "c": 3}  # a reads pages; b just past the window; c still in its sink
BATCH = [(rid, n, 1) for rid, n in PROMPTS.items()]


def prefilled_store(rows: int = 8, **kw):
    cfg, store = make_store(**kw)
    store.enable_graphs(rows)
    store.windows.allocate_all(trash=True)
    gen = torch.Generator().manual_seed(3)
    hq, hk, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    for rid, n in PROMPTS.items():
        q, k, v = (torch.randn(1, h, n, d, generator=gen) for h in (hq, hk, hk))
        for layer in range(cfg.num_hidden_layers):
            store.attend(layer, q, k, v, [(rid, 0, n)], d**-0.5, FakeAttention(), "sdpa")
    return cfg, store


def step_inputs(cfg, rows: int, seed: int, garbage_from: int | None = None):
    """Per layer ``(q, k, v)`` of ``rows`` packed decode rows (row ``i`` the same whatever ``rows``; rows from
    ``garbage_from`` on: large values)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(cfg.num_hidden_layers):
        q, k, v = (torch.randn(1, h, 8, cfg.head_dim, generator=gen)[:, :, :rows].clone() for h in
                   (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_key_value_heads))
        if garbage_from is not None:
            for t in (q, k, v):
                t[:, :, garbage_from:] = 1e4
        out.append((q, k, v))
    return out


def forward(store, cfg, batch, inputs):
    d = cfg.head_dim
    return [store.attend(layer, q, k, v, batch, d**-0.5, FakeAttention(), "sdpa") for layer, (q, k, v) in
            enumerate(inputs)]


def state(store, rids):
    """What the real requests hold: their window slots and pages (every part, every layer)."""
    out = []
    for rid in rids:
        r = store.requests[rid]
        out += [store.windows.k[r.slot], store.windows.v[r.slot], r.lengths]
        out += [t[page] for page in r.table for t in store.pool.tensors]
    return out


def assert_same(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y)
        else:
            assert x == y


@pytest.mark.parametrize("kw", [{}, *HEADS])
def test_padded_rows_change_nothing_of_the_real_requests(kw):
    """(d) A graphed step padded with rows of garbage gives the real rows what the unpadded step gives, leaves the
    real requests' windows and pages as that step does, and writes only to the trash slot and the trash page."""
    results = []
    for rows in (3, 7):
        cfg, store = prefilled_store(**kw)
        for step in range(12):  # a crosses a page boundary, b starts demoting, c leaves its sink
            batch = [(rid, n + step, 1) for rid, n in PROMPTS.items()]
            plan = store.plan_decode(batch, rows)
            assert plan.graphable and plan.write.pos.shape[0] == rows
            outs = forward(store, cfg, batch, step_inputs(cfg, rows, seed=step, garbage_from=3))
            results.append((rows, step, [o[:, :3] for o in outs]))
        assert_same_later = state(store, PROMPTS)
        results.append((rows, "state", assert_same_later))
        if rows == 7:  # the padded rows wrote somewhere: the trash slot and the trash page, nowhere else
            t = store.windows.trash_slot
            assert store.windows.k[t].abs().max() == 1e4
            assert store.pool.int2.codes[store.pool.trash_page].any() or not store.pool.int2_heads[0]
    unpadded = [r for r in results if r[0] == 3]
    padded = [r for r in results if r[0] == 7]
    for (_, s1, a), (_, s2, b) in zip(unpadded, padded):
        assert s1 == s2
        assert_same(a, b)


@pytest.mark.parametrize("kw", [{}, HEADS[0]])
def test_replaying_a_captured_step_equals_fresh_eager_steps(kw):
    """(c) One store captures its decode forward once per history bound (emulated CUDA graph: recorded ops, writes
    undone, no host sync) and then only plans each step (the prepare hook) and replays; another runs every step
    eagerly. Outputs and the requests' state agree at every step."""
    cfg, graphed = prefilled_store(**kw)
    _, eager = prefilled_store(**kw)
    rows = 4
    static_in = step_inputs(cfg, rows, seed=0)  # the graph's input buffers
    static_out = [torch.zeros(1, rows, cfg.num_attention_heads, cfg.head_dim) for _ in static_in]
    graphs = {}
    for step in range(20):  # a's history grows from 5 pages of 4 to 10: past the first bound (8 pages)
        batch = [(rid, n + step, 1) for rid, n in PROMPTS.items()]
        new_in = step_inputs(cfg, rows, seed=100 + step)
        plan = graphed.plan_decode(batch, rows)
        assert plan.graphable
        for dst, src in zip(static_in, new_in):
            for d, s in zip(dst, src):
                d.copy_(s)

        def run():
            for o, x in zip(static_out, forward(graphed, cfg, batch, static_in)):
                o.copy_(x)

        graph = graphs.get(plan.pages.max_len)
        if graph is None:  # what Transformers does for a new key: a warmup forward, then the capture
            run()
            graph = graphs[plan.pages.max_len] = EmulatedGraph()
            with graph.capture():
                run()
        else:
            graph.replay()
        eager.plan_decode(batch)  # eager: exact history bound, no padded row
        want = forward(eager, cfg, batch, [tuple(t[:, :, :3] for t in x) for x in new_in])
        for got, w in zip(static_out, want):
            torch.testing.assert_close(got[:, :3], w, rtol=1e-5, atol=1e-6)
        for x, y in zip(state(graphed, PROMPTS), state(eager, PROMPTS)):
            if isinstance(x, torch.Tensor):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
            else:
                assert x == y
    assert len(graphs) >= 2  # the history bound grew: a second graph


@pytest.mark.parametrize("kw", [{}, *HEADS])
def test_decode_forward_has_no_host_sync(kw):
    """(b) Once planned, a decode forward (write and read of every layer, retrieval heads included) runs no host
    synchronization and no data-dependent shape."""
    cfg, store = prefilled_store(**kw)
    for step in range(10):
        batch = [(rid, n + step, 1) for rid, n in PROMPTS.items()]
        store.plan_decode(batch, 4)
        with NoHostSync():
            forward(store, cfg, batch, step_inputs(cfg, 4, seed=step))


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("storage", [{}, dict(group_size=32, key_bits=3, value_group_size=128)],
                         ids=["int2", "k3-own-value-group"])
def test_generate_batch_with_real_cuda_graphs(monkeypatch, storage):
    """On CUDA (a small bf16 Qwen3 with the production head shape: the Triton kernels run): ``generate_batch`` with
    ``use_cuda_graph=True`` captures and replays Transformers' graphs over OSCAR's decode steps and gives the tokens
    of the same steps run eagerly (the same plans: padded rows, history bounds); the first token (prefill, eager in
    both) and most of the rest equal the run with graphs off (its grids are sized for the exact histories: bf16
    rounding may flip a near-tie of this random model)."""
    from batch_utils import cuda_qwen3

    from oscar_hf.serving.paged_attention import RecordedBatch

    model = cuda_qwen3(seed=1)
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 1000) for _ in range(n)] for n in (300, 700, 90, 1200, 450, 30)]
    gen = GenerationConfig(max_new_tokens=48, do_sample=False, eos_token_id=None, pad_token_id=0)
    replays = []
    replay = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: replays.append(1) or replay(self))

    def run(graphs: bool):
        # (the KV read padded to pages: Transformers' 5.17 - 5.19 key would change each page; the store's does not)
        extra = dict(use_cuda_graph=True, q_padding_interval_size=4, kv_padding_interval_size=64) if graphs else \
            dict(use_cuda_graph=False)
        cb = continuous_batching_config(num_blocks=256, max_batch_tokens=2048, page_size=64,
                                        max_requests_per_batch=4, **extra)
        with paged_oscar(model, method="hadamard", max_requests=8, sink=16, recent=32,
                         **{"group_size": 64, **storage}) as store:
            out = model.generate_batch(prompts, gen, continuous_batching_config=cb, warmup=False)
            assert store.pool.num_used == 0
        return [r.generated_tokens for r in out.values()]

    graphed = run(True)
    assert len(replays) > 20
    prepare = RecordedBatch.prepare_forward

    def planned_but_eager(self, rows, packed=None):  # the graphed run's plans (packed rows checked), without a graph
        prepare(self, rows, packed)
        self.graph_step = False
        return False

    monkeypatch.setattr(RecordedBatch, "prepare_forward", planned_but_eager)
    n = len(replays)
    assert run(True) == graphed and len(replays) == n
    monkeypatch.undo()
    plain = run(False)
    assert [t[0] for t in plain] == [t[0] for t in graphed]
    same = sum(a == b for x, y in zip(plain, graphed) for a, b in zip(x, y))
    assert same >= 0.8 * sum(len(t) for t in plain)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_generate_batch_matches_oscar_generate_at_real_lengths():
    """On CUDA, prompts of 2-6K tokens: ``generate_batch`` with CUDA graphs (the paged read on the Gluon history
    kernel: ``gluon_min_work`` set to 0 for the test, as 24 requests x 32K reach it by themselves) against each prompt
    alone through ``OscarCache`` (the contiguous storage and op, compiled by ``generate``): the same first token
    (exact prefill in both) and most of the rest (the two kernels round bf16 in another order; this random model has
    near-ties)."""
    from batch_utils import cuda_qwen3

    from oscar_hf.kernels import decode_triton
    from oscar_hf.kernels.plan import DEFAULTS

    model = cuda_qwen3(seed=2)
    rng = random.Random(2)
    prompts = [[rng.randrange(1, 1000) for _ in range(n)] for n in (2100, 4500, 6000, 3300)]
    new = 24
    gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    oscar = dict(method="hadamard", sink=64, recent=128, group_size=64)
    gluon_calls = []
    glu = decode_triton._gluon_module()
    real = glu.launch_history
    old = DEFAULTS.gluon_min_work
    object.__setattr__(DEFAULTS, "gluon_min_work", 0)  # (a frozen dataclass: the defaults every launcher binds)
    glu.launch_history = lambda *a, **kw: (gluon_calls.append(kw.get("paged") is not None), real(*a, **kw))[1]
    try:
        cb = continuous_batching_config(num_blocks=512, max_batch_tokens=8192, page_size=256, use_cuda_graph=True,
                                        q_padding_interval_size=4)
        with paged_oscar(model, max_requests=8, **oscar) as store:
            out = model.generate_batch(prompts, gen, continuous_batching_config=cb, warmup=False)
            assert store.pool.num_used == 0
        served = [out[k].generated_tokens for k in sorted(out, key=lambda k: int(k.split("_")[-1]))]
        assert any(gluon_calls), "the paged read never ran on the Gluon kernel"
        alone_tokens = []
        for prompt in prompts:
            kw = dict(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
            kw.update(cache_kwargs(model, OscarCache(model, **oscar)))
            alone_tokens.append(model.generate(torch.tensor([prompt], device="cuda"), **kw)[0, len(prompt):].tolist())
    finally:
        object.__setattr__(DEFAULTS, "gluon_min_work", old)
        glu.launch_history = real
    assert [t[0] for t in served] == [t[0] for t in alone_tokens]
    same = sum(a == b for x, y in zip(served, alone_tokens) for a, b in zip(x, y))
    assert same >= 0.8 * new * len(prompts), (served, alone_tokens)


def test_graphs_refused_where_the_attention_function_updates_the_cache(model, monkeypatch):
    """Transformers 5.20 - 5.23 (Transformers' sdpa function calls ``cache.update``): ``use_cuda_graph=True`` is
    refused at the manager's construction, naming the version, instead of failing inside the capture."""
    from oscar_hf.serving import batching

    if not batching.SECTOR_API:
        pytest.skip("5.17 - 5.19: the layer-independent paged functions")
    monkeypatch.setattr(batching.OscarPagedCache, "updates_in_attention", True)
    with pytest.raises(NotImplementedError, match="5.24"):
        batching._check_cb_config(batching.continuous_batching_config(use_cuda_graph=True))
    batching._check_cb_config(batching.continuous_batching_config(use_cuda_graph=False))
