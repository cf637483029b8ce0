"""OSCAR for a process that loads its models itself (:func:`oscar_serving`), and in the model process ``transformers
serve`` spawns (5.25+: its entry point ``EngineClient.run_engine`` is replaced inside the block, and the serving process
refuses a repeated live ``X-Request-ID`` itself and answers a stream the model process refuses with a 400);
docs/serving.md."""
from __future__ import annotations

import contextlib
import contextvars
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
    original = vars(_engine_client())["run_engine"]  # (the child's own, before its block replaces it)
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


# a streamed request's record while its handler runs: {"streamer": its Detokenizer, "error": the ValueError that
# failed it}; the task that sends it to the model process copies the handler's context, so both see one dict
_STREAMED: contextvars.ContextVar[dict] = contextvars.ContextVar("oscar_streamed")


def recording_refusals(send_request):
    """``_send_request`` for 5.25's ``EngineClient``: a streamed request's streamer, and the ValueError (a refusal,
    the request's fault) that fails it, recorded for :func:`refusing_before_streaming`."""
    async def send(self, method, args, streamer=None):
        seen = _STREAMED.get(None) if streamer is not None else None
        if seen is not None:
            seen["streamer"] = streamer
        try:
            return await send_request(self, method, args=args, streamer=streamer)
        except ValueError as e:
            if seen is not None:
                seen["error"] = e
            raise

    return send


def refusing_before_streaming(handle_request):
    """``handle_request`` for 5.25's completion handlers: a streamed request refused in the model process (a ValueError
    before its first token: a prompt the pool cannot hold, ...) is answered 400 with the reason, as a plain request
    is (raised here, the server's ValueError handler answers it), not with an error event in a 200 stream. So the
    stream's first chunks wait for its first token or its end."""
    async def handle(self, body: dict, request_id: str):
        seen = {}
        token = _STREAMED.set(seen)
        try:
            response = await handle_request(self, body, request_id)
        finally:
            _STREAMED.reset(token)
        if not (isinstance(body, dict) and body.get("stream")) or not hasattr(response, "body_iterator"):
            return response
        body_iterator, head = response.body_iterator, []
        while "error" not in seen and not getattr(seen.get("streamer"), "total_tokens", 0):
            try:
                head.append(await body_iterator.__anext__())
            except StopAsyncIteration:
                break
        if "error" in seen:
            await body_iterator.aclose()
            raise seen["error"]

        async def stream():
            try:
                for part in head:
                    yield part
                async for part in body_iterator:
                    yield part
            finally:
                await body_iterator.aclose()

        response.body_iterator = stream()
        return response

    return handle


@contextlib.contextmanager
def oscar_serving(rotations=None, scheduler_type: str | None = None, **store_kwargs):
    """:func:`oscar_continuous_batching` for a process that loads its models itself (``transformers serve``): each
    manager's cache gets a fresh :class:`OscarPagedStore(config, rotations, **store_kwargs)`, and its scheduler is
    ``scheduler_type`` where given."""

    def make_store(config, device, dtype):
        return OscarPagedStore(config, rotations, device=device, dtype=dtype, defer_pool=True, **store_kwargs)

    client = _engine_client()
    with contextlib.ExitStack() as undo, oscar_continuous_batching(make_store, scheduler_type=scheduler_type) as stores:
        if client is not None:  # a model process the server spawns serves through OSCAR too (module docstring)
            from transformers.cli.serving.chat_completion import ChatCompletionHandler
            from transformers.cli.serving.completion import CompletionHandler
            from transformers.cli.serving.utils import RequestIdMiddleware

            patches = [(client, "run_engine", staticmethod(functools.partial(run_engine, (rotations, dict(
                store_kwargs, scheduler_type=scheduler_type))))),
                       (client, "_send_request", recording_refusals(vars(client)["_send_request"])),
                       (RequestIdMiddleware, "__call__", refusing_live_ids(RequestIdMiddleware))]
            patches += [(h, "handle_request", refusing_before_streaming(vars(h)["handle_request"]))
                        for h in (CompletionHandler, ChatCompletionHandler)]
            for owner, name, value in patches:
                undo.callback(setattr, owner, name, vars(owner)[name])
                setattr(owner, name, value)
        yield stores
