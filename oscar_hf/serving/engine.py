"""OSCAR for a process that loads its models itself (:func:`oscar_serving`), and in the model process ``transformers
serve`` spawns (Transformers 5.25+).

From 5.25 the server loads the model and runs its continuous-batching manager in a process of its own, started with
the ``spawn`` method (``transformers.cli.serving.model_manager.EngineClient.start_process``): nothing the serving
process patched is there, so an :func:`~oscar_hf.serving.oscar_serving` block around the server alone would serve plain
BF16. Inside the block the model process's entry point (``EngineClient.run_engine``, which the parent hands to the
child by name) is replaced by :func:`run_engine`, a module function of ours bound to the block's settings (pickled
with the process's arguments): the child enters its own ``oscar_serving`` block, then runs Transformers' entry point.
On earlier releases (the model runs in the serving process) nothing is replaced.
"""
from __future__ import annotations

import contextlib
import functools

from .batching import oscar_continuous_batching
from .store import OscarPagedStore


def _engine_client():
    try:
        from transformers.cli.serving.model_manager import EngineClient
    except ImportError:  # no serving extra
        return None
    return EngineClient if "run_engine" in vars(EngineClient) else None


def run_engine(settings: tuple, *args, **kwargs):
    """The model process's entry point inside an OSCAR block: ``settings`` are the block's ``(rotations,
    store_kwargs)``; the rest goes to Transformers' ``EngineClient.run_engine`` (which serves until the process ends)."""
    client = _engine_client()
    original = vars(client)["run_engine"]  # (the child's own, before its block replaces it)
    rotations, store_kwargs = settings
    with oscar_serving(rotations, **store_kwargs):
        return original.__func__(*args, **kwargs)


@contextlib.contextmanager
def model_processes(rotations, store_kwargs: dict):
    """Inside: a model process the server spawns serves through OSCAR with these settings (see the module docstring)."""
    client = _engine_client()
    if client is None:
        yield
        return
    original = vars(client)["run_engine"]
    client.run_engine = staticmethod(functools.partial(run_engine, (rotations, dict(store_kwargs))))
    try:
        yield
    finally:
        client.run_engine = original


@contextlib.contextmanager
def oscar_serving(rotations=None, **store_kwargs):
    """:func:`oscar_continuous_batching` for a process that loads its models itself (``transformers serve``,
    ``scripts/serve.py``): each manager's cache gets a fresh :class:`OscarPagedStore` for the model it serves
    (``rotations`` an :class:`~oscar_hf.OscarRotations` or None for the artifact-free ``method``; ``store_kwargs``
    its other arguments, e.g. ``max_requests``, ``sink``)."""

    def make_store(config, device, dtype):
        return OscarPagedStore(config, rotations, device=device, dtype=dtype, defer_pool=True, **store_kwargs)

    # (5.25+ `transformers serve` runs the model in a process it spawns: that process enters a block of its own)
    with model_processes(rotations, store_kwargs), oscar_continuous_batching(make_store) as stores:
        yield stores
