"""OSCAR for a process that loads its models itself (:func:`oscar_serving`), and in the model process ``transformers
serve`` spawns (5.25+: its entry point ``EngineClient.run_engine`` is replaced inside the block, and the serving process
refuses a repeated live ``X-Request-ID`` itself); docs/serving.md."""
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
    """The ``oscar_hf`` logger's INFO lines on stderr, beside Transformers' own."""
    log = logging.getLogger("oscar_hf")
    if not any(type(h) is logging.StreamHandler for h in log.handlers):  # (oscar_hf installs a NullHandler)
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s oscar_hf: %(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)


# logged with the store's stats by a 5.25+ model process told to stop (its manager never stops before)
STORE_AT_EXIT = "OSCAR store at its model process's end; it held:"


def run_engine(settings: tuple, *args, **kwargs):
    """The model process's entry point inside an OSCAR block: ``settings`` are the block's ``(rotations,
    store_kwargs)``; the rest goes to Transformers' ``EngineClient.run_engine`` (serving until the process ends)."""
    client = _engine_client()
    original = vars(client)["run_engine"]  # (the child's own, before its block replaces it)
    rotations, store_kwargs = settings
    log_to_stderr()  # (the server's own process did the same)
    with oscar_serving(rotations, **store_kwargs) as stores:
        def on_term(signum, frame):  # the model process's end: each live store logs its stats, then the default action
            for store in stores:
                logging.getLogger("oscar_hf").info("%s %s", STORE_AT_EXIT, json.dumps(store.stats()))
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, on_term)
        return original.__func__(*args, **kwargs)


def refusing_live_ids(middleware):
    """``__call__`` for 5.25's ``RequestIdMiddleware``: a POST whose ``X-Request-ID`` names a request still being
    answered is refused with admission's 409. The ids live in this closure (one event loop: no lock)."""
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
def oscar_serving(rotations=None, **store_kwargs):
    """:func:`oscar_continuous_batching` for a process that loads its models itself (``transformers serve``): each
    manager's cache gets a fresh :class:`OscarPagedStore(config, rotations, **store_kwargs)`."""

    def make_store(config, device, dtype):
        return OscarPagedStore(config, rotations, device=device, dtype=dtype, defer_pool=True, **store_kwargs)

    client = _engine_client()
    with contextlib.ExitStack() as undo, oscar_continuous_batching(make_store) as stores:
        if client is not None:  # a model process the server spawns serves through OSCAR too (module docstring)
            from transformers.cli.serving.utils import RequestIdMiddleware

            undo.callback(setattr, client, "run_engine", vars(client)["run_engine"])
            undo.callback(setattr, RequestIdMiddleware, "__call__", vars(RequestIdMiddleware)["__call__"])
            client.run_engine = staticmethod(functools.partial(run_engine, (rotations, dict(store_kwargs))))
            RequestIdMiddleware.__call__ = refusing_live_ids(RequestIdMiddleware)
        yield stores
