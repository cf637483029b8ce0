"""OSCAR for a process that loads its models itself (:func:`oscar_serving`), and in the model process ``transformers
serve`` spawns (Transformers 5.25+).

From 5.25 the server loads the model and runs its continuous-batching manager in a process of its own, started with
the ``spawn`` method (``transformers.cli.serving.model_manager.EngineClient.start_process``): nothing the serving
process patched is there, so an :func:`~oscar_hf.serving.oscar_serving` block around the server alone would serve plain
BF16. Inside the block the model process's entry point (``EngineClient.run_engine``, which the parent hands to the
child by name) is replaced by :func:`run_engine`, a module function of ours bound to the block's settings (pickled
with the process's arguments): the child enters its own ``oscar_serving`` block, then runs Transformers' entry point.
There the manager never sees the ``X-Request-ID`` header (the model process numbers requests itself), so the
serving process refuses a repeated live id itself (:func:`refusing_live_ids`, 409 as admission gives on earlier
releases). On earlier releases (the model runs in the serving process) nothing is replaced.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal

from .batching import oscar_continuous_batching
from .store import OscarPagedStore


def _engine_client():
    try:
        from transformers.cli.serving.model_manager import EngineClient
    except ImportError:  # no serving extra
        return None
    return EngineClient if "run_engine" in vars(EngineClient) else None


def log_to_stderr() -> None:
    """A server's log: the ``oscar_hf`` logger's INFO lines (a stopped manager's store released, with what it still
    held; layers left in BF16) on stderr, beside Transformers' own."""
    log = logging.getLogger("oscar_hf")
    if not any(type(h) is logging.StreamHandler for h in log.handlers):  # (oscar_hf installs a NullHandler)
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s oscar_hf: %(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)


def run_engine(settings: tuple, *args, **kwargs):
    """The model process's entry point inside an OSCAR block: ``settings`` are the block's ``(rotations,
    store_kwargs)``; the rest goes to Transformers' ``EngineClient.run_engine`` (which serves until the process ends)."""
    client = _engine_client()
    original = vars(client)["run_engine"]  # (the child's own, before its block replaces it)
    rotations, store_kwargs = settings
    log_to_stderr()  # (the server's own process did the same)
    with oscar_serving(rotations, **store_kwargs) as stores:
        _log_stores_on_sigterm(stores)
        return original.__func__(*args, **kwargs)


# logged (INFO, the store's stats as JSON) by a 5.25+ model process told to stop: its manager never stops before (a
# model switch there is another process), so this is where its log says what the store still held
STORE_AT_EXIT = "OSCAR store at its model process's end; it held:"


def _log_stores_on_sigterm(stores) -> None:
    """The model process ends on SIGTERM (idle past ``--model-timeout``, or the server stopping): first each live
    store of the block logs its stats, then the signal's default action ends the process as before."""
    logger = logging.getLogger("oscar_hf")

    def on_term(signum, frame):
        for store in stores:
            logger.info("%s %s", STORE_AT_EXIT, json.dumps(store.stats()))
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)


def refusing_live_ids(middleware):
    """``__call__`` for 5.25's ``RequestIdMiddleware`` (the serving process's ASGI middleware that reads the
    ``X-Request-ID`` header): a POST whose header names a request still being answered (its handler, a stream's whole
    body included, not yet returned) is refused with the 409 that admission gives on earlier releases
    (:func:`~oscar_hf.serving.admission.live_id_refusal`). The model process numbers requests itself from 5.25, so
    its manager never sees the header: without this a retry with the same id was served as a new request. The ids
    live in this closure (one uvicorn event loop: no lock); one whose handler ends, fails or is cancelled (a client
    leaving) is free again."""
    from starlette.datastructures import Headers
    from starlette.responses import JSONResponse

    from .admission import live_id_refusal

    original, live = middleware.__call__, set()

    async def call(self, scope, receive, send) -> None:
        post = scope["type"] == "http" and scope["method"] == "POST"
        rid = Headers(scope=scope).get("x-request-id") if post else None
        if rid is None:
            return await original(self, scope, receive, send)
        if rid in live:
            refused = live_id_refusal(rid)
            answer = JSONResponse({"detail": refused.detail}, status_code=refused.status_code,
                                  headers={"x-request-id": rid})
            return await answer(scope, receive, send)
        live.add(rid)
        try:
            return await original(self, scope, receive, send)
        finally:
            live.discard(rid)

    return call


@contextlib.contextmanager
def model_processes(rotations, store_kwargs: dict):
    """Inside: a model process the server spawns serves through OSCAR with these settings, and a repeated live
    ``X-Request-ID`` is refused in the serving process (:func:`refusing_live_ids`; see the module docstring)."""
    client = _engine_client()
    if client is None:
        yield
        return
    from transformers.cli.serving.utils import RequestIdMiddleware

    original, call = vars(client)["run_engine"], vars(RequestIdMiddleware)["__call__"]
    client.run_engine = staticmethod(functools.partial(run_engine, (rotations, dict(store_kwargs))))
    RequestIdMiddleware.__call__ = refusing_live_ids(RequestIdMiddleware)
    try:
        yield
    finally:
        client.run_engine = original
        RequestIdMiddleware.__call__ = call


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
