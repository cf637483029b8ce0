"""CUDA graphs emulated on the CPU, for the tests of OSCAR's graph-safe decode step (imported as a plain module).

:class:`EmulatedGraph` stands in for ``torch.cuda.CUDAGraph``. Its capture records the aten ops a region runs (a
``TorchDispatchMode``) and then undoes every write they made (a real capture executes nothing); its replay re-runs
the recorded ops with no Python of the region: a tensor the region created is the replayed op's new output, every
other tensor (weights, caches, the static buffers the prepare hooks write) is the same object, read as it is now.
So a replay computes what the graph would: a value the region read on the host at capture time (a slice bound, a
``torch.tensor`` of Python numbers, a branch) stays frozen, and any state the region's Python updates is not updated.
With ``forbid_sync`` the capture also raises on what a CUDA capture cannot do: a host synchronization (``.item()``,
``bool(tensor)``: ``aten._local_scalar_dense``; ``.tolist()``, ``.numpy()``, which skip aten on the CPU) or an op
whose output shape depends on tensor values.

:func:`emulate_cuda_graphs` patches Transformers' continuous batching (5.17 - 5.19 and 5.20+) so that, on the CPU,
``use_cuda_graph=True`` keeps its graphs and captures / replays :class:`EmulatedGraph` objects.
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

aten = torch.ops.aten
# ops whose output shape depends on the values of their input (a host synchronization on CUDA), and the scalar read
SYNC_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
            aten.unique_consecutive.default, aten._unique2.default, aten.unique_dim.default,
            aten.repeat_interleave.Tensor, aten.argwhere.default, aten.nonzero_static.default}


SYNC_PACKETS = {f.overloadpacket for f in SYNC_OPS}


def is_sync(func) -> bool:
    return func in SYNC_OPS or getattr(func, "overloadpacket", None) in SYNC_PACKETS


class HostSync(RuntimeError):
    """A host synchronization (or a data-dependent shape) where none may be."""


# what reads a tensor's values into Python without an aten op on the CPU (on CUDA each is a device-to-host copy)
HOST_READS = ("tolist", "numpy", "__array__")


class _ForbidHostReads:
    """Inside: :data:`HOST_READS` raise :class:`HostSync`."""

    def __enter__(self):
        self._saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

        def refuse(name):
            def read(*args, **kwargs):
                raise HostSync(f"Tensor.{name}() in a region that must not synchronize with the host")
            return read

        for name in HOST_READS:
            setattr(torch.Tensor, name, refuse(name))

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(torch.Tensor, name, fn)


class NoHostSync(TorchDispatchMode):
    """Raises :class:`HostSync` inside the block on :data:`SYNC_OPS` and :data:`HOST_READS`."""

    def __enter__(self):
        self._reads = _ForbidHostReads()
        self._reads.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        self._reads.__exit__(*exc)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if is_sync(func):
            raise HostSync(f"{func} in a region that must not synchronize with the host")
        return func(*args, **(kwargs or {}))


class _Recorder(TorchDispatchMode):
    def __init__(self, forbid_sync: bool):
        super().__init__()
        self.forbid_sync = forbid_sync
        self._reads = _ForbidHostReads() if forbid_sync else None
        self.ops: list = []
        self.saved: dict[int, tuple] = {}  # storage pointer -> (storage, a copy from before the region wrote it)

    def __enter__(self):
        if self._reads is not None:
            self._reads.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        if self._reads is not None:
            self._reads.__exit__(*exc)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.forbid_sync and is_sync(func):
            raise HostSync(f"{func} inside a CUDA-graph capture")
        schema = func._schema.arguments
        values = [*args, *[kwargs.get(a.name) for a in schema[len(args):]]]
        for arg, value in zip(schema, values):
            if arg.alias_info is not None and arg.alias_info.is_write:
                for t in tree_leaves(value):
                    if isinstance(t, torch.Tensor):
                        st = t.untyped_storage()
                        self.saved.setdefault(st.data_ptr(), (st, st.clone()))
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out

    def undo(self) -> None:
        for st, before in self.saved.values():
            st.copy_(before)


class EmulatedGraph:
    """``torch.cuda.CUDAGraph`` on the CPU (module docstring). ``captures`` / ``replays`` count the calls."""

    log: list = []  # (event, graph) of every graph, in order: what a test reads

    def __init__(self, forbid_sync: bool = True):
        self.forbid_sync = forbid_sync
        self.ops = None

    @contextlib.contextmanager
    def capture(self):
        rec = _Recorder(self.forbid_sync)
        with rec:
            yield self
        rec.undo()  # a capture executes nothing
        self.ops = rec.ops
        EmulatedGraph.log.append(("capture", self))

    def replay(self) -> None:
        env: dict[int, torch.Tensor] = {}

        def now(x):
            return env.get(id(x), x) if isinstance(x, torch.Tensor) else x

        for func, args, kwargs, out in self.ops:
            new = func(*tree_map(now, args), **tree_map(now, kwargs))
            for old, fresh in zip(tree_leaves(out), tree_leaves(new)):
                if isinstance(old, torch.Tensor):
                    env[id(old)] = fresh
        EmulatedGraph.log.append(("replay", self))

    def reset(self) -> None:
        self.ops = None


def emulate_cuda_graphs(monkeypatch) -> list:
    """Patch Transformers' continuous batching (the installed release) so that CUDA graphs run as
    :class:`EmulatedGraph` on the CPU; returns the graph log (cleared)."""
    from transformers.generation.continuous_batching import initialization, model_runner

    def decide_use_cuda_graphs(cb_config, *args, **kwargs):  # the user's choice, as on a CUDA machine
        u = cb_config.use_cuda_graph
        cb_config.use_cuda_graph = (u, u) if isinstance(u, bool) else tuple(u) if u is not None else (False, False)

    monkeypatch.setattr(initialization, "decide_use_cuda_graphs", decide_use_cuda_graphs)
    if hasattr(model_runner, "create_accelerator_graph"):  # 5.20+
        monkeypatch.setattr(model_runner, "get_memory_pools", lambda: (None, None))
        monkeypatch.setattr(model_runner, "memory_pool_context", lambda pool: contextlib.nullcontext())
        monkeypatch.setattr(model_runner, "create_accelerator_graph", EmulatedGraph)
        monkeypatch.setattr(model_runner, "accelerator_graph_capture_context",
                            lambda graph, stream=None, pool=None: graph.capture())
    else:  # 5.17 - 5.19
        monkeypatch.setattr(model_runner, "get_cuda_pools", lambda: (None, None))
        monkeypatch.setattr(model_runner, "mem_pool_ctx", lambda pool: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "CUDAGraph", EmulatedGraph)
        monkeypatch.setattr(torch.cuda, "graph", lambda graph, **kwargs: graph.capture())
    EmulatedGraph.log.clear()
    return EmulatedGraph.log
