"""The decode op's kernels compiled ahead in a helper process (:mod:`oscar_hf.kernels.step_warmup`): the description
of a call's arguments and the tensors rebuilt from it (layouts, the retrieval heads' index), the helper process
itself, and the parent's side (a helper per compile, fed each distinct set once, released at the op's first real
call, nothing off CUDA). Whether it shortens the first call is a GPU benchmark's (docs/results.md)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from kernel_utils import setup_interpreter

setup_interpreter()  # before any kernel module is imported

from test_append_token import _tokens  # noqa: E402
from test_static_op import CASES, _case, _step_args, _storage  # noqa: E402

from oscar_hf.kernels import step_warmup  # noqa: E402
from oscar_hf.kernels.static_op import (  # noqa: E402
    _PARAMS, decode_step, decode_step_, split_heads_index, warm_args)


def _args(heads, bits, t=7):
    layer, gen, g, win_mask, sinks = _case(heads, bits)
    b, hk, _, d = layer.win_k.shape
    q = torch.randn(b, hk, g, d, generator=gen).to(torch.bfloat16)
    new_k, new_v = _tokens(layer, t)
    args = _step_args(layer, q, new_k, new_v, t, torch.tensor([0, 3]), win_mask, sinks, 0.0)
    return (*args, *_storage(layer))


def _gpu_args(heads, bits, d=128):
    """One decode step's arguments on CUDA at a kernel-sized shape (as tests/kernels/test_static_op.py's GPU test):
    kernels on, the lengths on the device."""
    from test_append_token import Layer
    from test_static_op import S0, W, _indices

    b, hk, g = 2, len(heads) if heads else 3, 4
    layer = Layer(b, hk, d, 64, S0, W, W + 4, 96, heads=heads, mu_k="3d", seed=d, coded_bits=bits, device="cuda")
    pad = torch.tensor([0, 3], device="cuda")
    win_mask = torch.ones(b, 1, 1, S0 + W + 4, dtype=torch.bool, device="cuda")
    q = torch.zeros(b, hk, g, d, dtype=torch.bfloat16, device="cuda")
    new = [torch.zeros(b, hk, 1, d, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    args = list(_step_args(layer, q, *new, 0, pad, win_mask, None, 0.0, _indices(layer)[1]))
    for name in ("length", "hist_len"):
        args[_PARAMS.index(name)] = torch.zeros((), dtype=torch.long, device="cuda")
    return (*args, *_storage(layer, True))


def _trace(args):
    """The op's fake implementation on ``args`` (what a trace runs for each layer)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    fake = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
    with mode:
        decode_step_(*fake)


def _layout(x):
    return None if x is None else (tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, x.device)


@pytest.mark.parametrize("heads,bits", CASES)
def test_described_arguments_rebuild_with_the_same_layouts_and_run(heads, bits):
    """Every tensor comes back with its shape, strides, storage offset, dtype and device (a strided view too), every
    other value as it was; the retrieval heads' index is a valid one for the layout; the op runs on the result."""
    args = list(_args(heads, bits))
    b, hk, g, d = args[0].shape
    args[0] = torch.randn(b, g, hk, d + 8).to(args[0].dtype)[..., 4:4 + d].transpose(1, 2)  # a strided view
    spec = json.loads(json.dumps(step_warmup.spec_of(tuple(args))))
    rebuilt = warm_args(spec)
    assert len(rebuilt) == len(args)
    named = dict(zip(_PARAMS, rebuilt))
    for a, r in zip(args, rebuilt):
        if isinstance(a, torch.Tensor):
            assert _layout(r) == _layout(a)
            assert not r.any() or r is named["heads_index"]
        else:
            assert r == a and type(r) is type(a)
    index = named["heads_index"]
    if index is not None:
        hk, hq = named["win"].shape[2], named["codes"].shape[2]
        hist_of, coded_of, int2_idx, coded_idx = split_heads_index(index, hk, hq)
        assert sorted(torch.cat([int2_idx, coded_idx]).tolist()) == list(range(hk))
        assert all(hist_of[h] == i for i, h in enumerate(int2_idx.tolist()))
        assert all(coded_of[h] == i for i, h in enumerate(coded_idx.tolist()))
        assert ((hist_of < 0) == (coded_of >= 0)).all()
    out = decode_step(*rebuilt)
    assert out.shape == args[0].shape and torch.isfinite(out).all()


def test_symbolic_sizes_and_unknown_values_are_not_described():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = FakeTensorMode().from_tensor(torch.zeros(4, 3))  # (what the first compile sees: fixed sizes)
    y = FakeTensorMode(shape_env=ShapeEnv()).from_tensor(torch.zeros(4, 3))  # (a recompile's symbolic capacity)
    assert step_warmup.spec_of((x,)) is not None
    assert step_warmup.spec_of((y,)) is None
    assert step_warmup.spec_of((object(),)) is None
    with pytest.raises(ValueError, match="arguments described"):
        warm_args({"args": [None]})


def _run_helper(lines: list[str]) -> subprocess.CompletedProcess:
    code = "from oscar_hf.kernels.static_op import warm_kernels; warm_kernels()"
    return subprocess.run([sys.executable, "-P", "-c", code],
                          input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=600)


def test_helper_runs_each_description_and_reports_a_bad_one():
    """The helper process reads one description a line, runs the op on each; one it cannot run is one line on its
    stderr, and it goes on with the next."""
    good = json.dumps(step_warmup.spec_of(_args([1, -1, 0], 8)))
    bad = json.dumps({"args": [None]})
    done = _run_helper([bad, good])
    assert done.returncode == 0
    assert done.stderr.count("compiling the decode kernels ahead failed") == 1, done.stderr
    assert "arguments described" in done.stderr


class _FakeProc:
    def __init__(self):
        self.lines, self.closed = [], False
        self.stdin = self

    def write(self, s):
        if self.closed:
            raise OSError("closed")
        self.lines.append(s)

    def flush(self):
        pass

    def close(self):
        self.closed = True


@pytest.fixture
def helpers(monkeypatch):
    """``note`` as on CUDA, with the helper process replaced by a recorder."""
    started = []

    def spawn(device, entry):
        assert entry == "oscar_hf.kernels.static_op:warm_kernels"
        started.append(_FakeProc())
        return started[-1]

    monkeypatch.setattr(step_warmup, "_spawn", spawn)
    monkeypatch.setattr(step_warmup._Helper, "proc", None)
    monkeypatch.setattr(step_warmup._Helper, "done", set())
    monkeypatch.setattr(step_warmup, "_on_cuda", lambda q: True)
    monkeypatch.setenv("OSCAR_WARM_KERNELS", "1")
    return started


def test_parent_feeds_each_distinct_layout_once_and_releases_at_the_first_real_call(helpers, monkeypatch):
    """The op's fake implementation (what a trace runs): one helper, each distinct set of arguments once; the op's
    first real call closes its input; the next compile gets a new helper, for sets not seen before only. Off CUDA, with
    ``use_kernels=False`` or without OSCAR_WARM_KERNELS=1: no helper."""
    a, b = _args(None, None), _args([1, -1, 0], 8)
    for args in (a, b, a, b):
        _trace(args)
    assert len(helpers) == 1 and len(helpers[0].lines) == 2
    assert json.loads(helpers[0].lines[0]) == step_warmup.spec_of(a)
    decode_step(*a)  # the first real call
    assert helpers[0].closed and step_warmup._Helper.proc is None
    _trace(a)
    assert len(helpers) == 1  # (seen: no new helper)
    _trace(_args([-1, 0, 1], 16))
    assert len(helpers) == 2 and len(helpers[1].lines) == 1
    off = list(_args([-1, -1, -1], 8))
    off[_PARAMS.index("use_kernels")] = "off"
    _trace(tuple(off))
    monkeypatch.delenv("OSCAR_WARM_KERNELS")
    _trace(_args([-1, -1, -1], 8))
    assert len(helpers) == 2 and len(helpers[1].lines) == 1
    monkeypatch.setattr(step_warmup, "_on_cuda", lambda q: q.is_cuda)
    monkeypatch.setenv("OSCAR_WARM_KERNELS", "1")
    _trace(_args([-1, -1, -1], 8))  # CPU tensors
    assert len(helpers) == 2 and len(helpers[1].lines) == 1
    monkeypatch.setattr(step_warmup, "_on_cuda", lambda q: True)
    _trace(_args([-1, -1, -1], 8))  # the same, as on CUDA: to the helper of this compile (not released yet)
    assert len(helpers) == 2 and len(helpers[1].lines) == 2


def test_compiled_trace_notes_every_layer(helpers):
    """Under torch.compile the op's fake implementation hands each distinct layer's arguments to the helper."""
    args = _args([1, -1, 0], 8)

    @torch.compile(fullgraph=True, backend="eager")
    def step(*a):
        return decode_step_(*a)

    step(*args)
    assert len(helpers) == 1 and len(helpers[0].lines) == 1 and helpers[0].closed


_KEYS = """
import importlib, json, os
from triton.runtime.jit import JITFunction
first = {first!r}
if first:  # a process that launched the prefill's write kernel before the decode step's
    importlib.import_module("oscar_hf.kernels.write_triton")._rotate_quantize_kernel.cache_key
mods = [importlib.import_module("oscar_hf.kernels." + m) for m in {mods!r}]
fns = {{f"{{m.__name__}}.{{k}}": v for m in mods for k, v in vars(m).items() if isinstance(v, JITFunction)}}
settled = all(f.hash is not None for f in fns.values())
print(json.dumps(dict(settled=settled, keys={{k: f.cache_key for k, f in fns.items()}})))
"""


def test_kernel_cache_keys_do_not_depend_on_what_a_process_launched_first():
    """The helper and the user's process compile the same kernel under one key of the on-disk cache: every jit
    function's key is computed at its module's import (plan.settle_cache_keys), so a kernel's key (Triton 3.6 folds
    its helpers' constexpr globals in only if their keys exist) is the same whether the process has launched another
    kernel sharing those helpers first (generate's prefill) or not (the helper)."""
    mods = ["write_triton", "append_triton", "query_triton", "decode_split", "decode_combine", "heads_triton"]
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}  # (compiled kernels' keys)
    runs = [json.loads(subprocess.run([sys.executable, "-P", "-c", _KEYS.format(first=first, mods=mods)], env=env,
                                      capture_output=True, text=True, check=True).stdout.splitlines()[-1])
            for first in (False, True)]
    assert runs[0]["settled"] and runs[1]["settled"]
    assert len(runs[0]["keys"]) >= 10 and runs[0]["keys"] == runs[1]["keys"]


_PARENT = """
import json, sys, torch
sys.path[:0] = {paths!r}
from kernel_utils import setup_interpreter
setup_interpreter()
from test_step_warmup import _gpu_args
from triton.runtime.cache import FileCacheManager
from oscar_hf.kernels import step_warmup
from oscar_hf.kernels.static_op import decode_step
from oscar_hf.kernels.write_path import rotate_quantize
x, r = torch.zeros(1, 2, 16, 128, dtype=torch.bfloat16, device="cuda"), torch.eye(128, device="cuda").repeat(2, 1, 1)
rotate_quantize(x, r, None, 1.0, 64, torch.bfloat16, use_kernels=True)  # (as a prefill: Triton has compiled here)
args = _gpu_args({heads!r}, {bits!r})
step_warmup.note(args, "oscar_hf.kernels.static_op:warm_kernels")
assert step_warmup.release().wait(timeout=600) == 0
puts, put = [], FileCacheManager.put
def record(self, data, filename, binary=True):
    puts.append(filename)
    return put(self, data, filename, binary)
FileCacheManager.put = record
decode_step(*args)
torch.cuda.synchronize()
print(json.dumps(puts))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("heads,bits", [(None, None), ([1, -1, 0], 8)])
def test_gpu_the_step_finds_the_helpers_kernels_on_disk(heads, bits, tmp_path):
    """A fresh process (empty Triton cache) that has compiled a kernel already (generate's prefill, before the trace)
    hands one layer's arguments to the helper, waits for it, then runs the op: every kernel the op needs is already in
    the cache on disk, under the keys this process computes (it writes no compiled kernel of its own)."""
    from pathlib import Path

    here = Path(__file__).resolve().parent
    code = _PARENT.format(paths=[str(here), str(here.parent)], heads=heads, bits=bits)
    env = dict(__import__("os").environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), OSCAR_WARM_KERNELS="1")
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    puts = json.loads(done.stdout.strip().splitlines()[-1])
    assert not [f for f in puts if f.endswith(".cubin")], puts
    assert list((tmp_path / "triton").rglob("*.cubin")), "the helper compiled nothing"


def test_compiled_generate_runs_a_real_helper_without_changing_tokens(monkeypatch, capfd):
    """generate's compiled route with the helper on (on the CPU, made to take the CUDA branch): one helper process
    starts during the compile, gets the layers' layouts, runs them without a failure and exits once the step runs;
    the tokens are those of the same call without it."""
    from batch_utils import cpu_compile_config

    from oscar_hf import OscarCache
    from oscar_hf.compat import cache_kwargs
    from oscar_hf.models import tiny_model

    m = tiny_model("qwen3")
    ids = torch.randint(3, m.config.vocab_size - 3, (1, 40), generator=torch.Generator().manual_seed(0))

    def greedy():
        torch._dynamo.reset()
        cache = OscarCache(m, compile=True, method="hadamard", sink=4, recent=8, group_size=32,
                           full_precision_heads=((1, 0),))
        return m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                          pad_token_id=0, compile_config=cpu_compile_config(), **cache_kwargs(m, cache))

    want = greedy()
    procs, spawn = [], step_warmup._spawn
    monkeypatch.setattr(step_warmup, "_spawn", lambda device, entry: procs.append(spawn(device, entry)) or procs[-1])
    monkeypatch.setattr(step_warmup, "_on_cuda", lambda q: True)
    monkeypatch.setattr(step_warmup._Helper, "proc", None)
    monkeypatch.setattr(step_warmup._Helper, "done", set())
    monkeypatch.setenv("OSCAR_WARM_KERNELS", "1")
    got = greedy()
    assert torch.equal(got, want)
    assert len(procs) == 1 and step_warmup._Helper.proc is None  # (released by the step's first run)
    assert procs[0].wait(timeout=600) == 0
    assert len(step_warmup._Helper.done) == 2  # a layer with a retrieval head, a layer without
    assert "compiling the decode kernels ahead failed" not in capfd.readouterr().err
