"""Every Transformers internal the serving integration touches, pinned: a release that renames or reshapes one fails
here, not in a user's server. Each method OSCAR's classes override must exist in their Transformers base with the
same parameters; each module global and attribute the integration swaps or reads must exist. Run on the installed
Transformers (CI: the newest 5.x; the GPU machine: 5.17)."""
from __future__ import annotations

import dataclasses
import inspect

import pytest
import transformers
from transformers.generation.continuous_batching import continuous_api

from oscar_hf import version
from oscar_hf.serving.batching import SECTOR_API, OscarPagedCache


def params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def overridden(cls) -> list[tuple[str, type, type]]:
    """``(name, owner, base)`` of each method ``cls`` or an OSCAR base of it (``RecordedBatch``, ``owner``) defines
    that a Transformers base also defines."""
    out, seen = [], set()
    for owner in [c for c in cls.__mro__ if c.__module__.startswith("oscar_hf")]:
        for name, value in vars(owner).items():
            if not callable(value) and not isinstance(value, (classmethod, property)) or name.startswith("__"):
                continue
            if name in seen:
                continue
            seen.add(name)
            for base in cls.__mro__[1:]:
                if base.__module__.startswith("transformers") and name in vars(base):
                    out.append((name, owner, base))
                    break
    return out


def our_classes() -> list[type]:
    classes = [OscarPagedCache]
    if SECTOR_API:
        from oscar_hf.serving.paged_cache import OscarCacheAllocator, OscarMemoryHandler

        classes += [OscarCacheAllocator, OscarMemoryHandler]
    return classes


@pytest.mark.parametrize("cls", our_classes(), ids=lambda c: c.__name__)
def test_overridden_methods_keep_their_transformers_signature(cls):
    pairs = overridden(cls)
    assert pairs, f"{cls.__name__} overrides nothing of Transformers?"
    for name, owner, base in pairs:
        ours, theirs = vars(owner)[name], vars(base)[name]
        if isinstance(ours, property):
            assert isinstance(theirs, property), name
            continue
        ours, theirs = getattr(ours, "__func__", ours), getattr(theirs, "__func__", theirs)
        if params(ours) == ["self", "args", "kwargs"]:  # a refusal of that method: any signature will do
            continue
        if params(ours)[-2:] == ["args", "kwargs"]:  # shared by both paged caches: its leading parameters, the rest
            assert params(theirs)[: len(params(ours)) - 2] == params(ours)[:-2], f"{base.__name__}.{name} changed"
            continue
        assert params(ours) == params(theirs), f"{base.__name__}.{name}{inspect.signature(theirs)} changed"


def test_module_globals_and_methods_the_integration_swaps():
    assert continuous_api.PagedAttentionCache.__name__ == "PagedAttentionCache"
    init = params(continuous_api.PagedAttentionCache.__init__)
    assert {"config", "continuous_batching_config", "device", "dtype"} <= set(init)
    manager = continuous_api.ContinuousBatchingManager
    assert params(manager._create_batch_processor) == ["self"]
    # a stopping manager gives its store's memory back: stop(...) clears batch_processor unless kept, is_running()
    assert params(manager.stop)[:5] == ["self", "block", "timeout", "keep_for_next_session", "hard_stop"]
    assert params(manager.is_running) == ["self"]
    assert "self.batch_processor = None" in inspect.getsource(manager.stop)
    if SECTOR_API:
        assert params(manager.switch_to_cb_friendly_attn) == ["self", "model", "auto_switch_to_flash"]
        assert hasattr(transformers.ContinuousBatchingConfig(), "auto_switch_to_flash")
        # the module globals the cache construction reads, which OSCAR's per-thread stand-ins replace while it builds
        from transformers.generation.continuous_batching import cache as cache_module

        source = inspect.getsource(cache_module.PagedAttentionCache)  # (5.25 builds allocators in a method)
        for read in ("ATTN_TYPE_TO_ALLOCATOR[attn_type]", "PagedAttentionMemoryHandler("):
            assert read in source, read
        # the bytes of a block: the full-attention class's (5.20 - 5.24) or the allocators' own (5.25), OSCAR's both
        assert ("FullAttentionCacheAllocator.get_bytes_per_page(" in source
                or "sum(ca.bytes_per_block for ca in self.cache_allocators.values())" in source)
        # the sizing OscarMemoryHandler extends: its fixed overhead is reserved before sectors are sized
        handler = cache_module.PagedAttentionMemoryHandler
        for name in ("fixed_overhead_bytes", "bytes_per_batch_token", "bytes_per_cache_sector"):
            assert isinstance(vars(handler)[name], property), name
        assert "self.fixed_overhead_bytes" in inspect.getsource(handler.infer_max_batch_tokens_and_num_sectors)
        assert isinstance(handler._default_max_batch_tokens, int)
    else:
        assert params(continuous_api.update_cb_config_after_cache_creation)[:2] == ["cb_config", "num_blocks"]
        # the admission OSCAR's prompt budget wraps on the scheduler instance (paged_cache_blocks.attach_scheduler)
        from transformers.generation.continuous_batching.scheduler import Scheduler

        assert params(Scheduler._allocate_blocks_if_needed) == ["self", "state", "len_next_tokens"]
    # what the OSCAR manager reads of the batch processor: its cache (checked) and scheduler (the request states)
    assert {"cache", "scheduler"} <= set(params(continuous_api.ContinuousBatchProcessor.__init__))
    from transformers.generation.continuous_batching.scheduler import Scheduler

    assert "self.active_requests: dict[str, RequestState]" in inspect.getsource(Scheduler)  # set in __init__ or reset


def test_the_cuda_graph_path_the_integration_wraps():
    """OSCAR's graphed decode steps (serving/batching.py, ``_install_graph_hooks``) wrap three instance attributes of
    the batch processor's runner and IO, and rely on how the runner picks, captures and replays a graph."""
    from transformers.generation.continuous_batching import model_runner
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs

    runner = model_runner.ModelRunner
    assert params(runner.compute_batch) == ["self", "model", "batch_data"]
    assert params(runner._get_forward_fn) == ["self", "use_block_table"]
    source = inspect.getsource(runner.compute_batch)
    for step in ("self._get_forward_fn(", "self.inputs_and_outputs.get_graph()", "graph.replay()",
                 "self._capture_graph("):
        assert step in source, step
    assert params(ContinuousBatchingIOs._get_graph_key) == ["self"]
    assert "self._get_graph_key()" in inspect.getsource(ContinuousBatchingIOs.get_graph)
    assert "self._get_graph_key()" in inspect.getsource(ContinuousBatchingIOs.set_graph)
    processor = inspect.getsource(continuous_api.ContinuousBatchProcessor)
    assert "self.model_runner = ModelRunner(" in processor and "self.inputs_and_outputs" in processor
    assert "self.model_runner.compute_batch(" in processor
    # the decode boolean OSCAR follows, and the padded row count it sizes its buffers for
    cbc = transformers.ContinuousBatchingConfig(use_cuda_graph=True)
    assert cbc.cuda_graph_booleans == (True, True) and hasattr(cbc, "q_padding_interval_size")


def test_request_state_and_config_fields_read():
    from transformers.generation.continuous_batching.requests import RequestState

    fields = {f.name for f in dataclasses.fields(RequestState)}
    assert "request_id" in fields
    assert "remaining_prefill_tokens" in fields  # whether a prompt's chunks go on (serving/paged_attention.py)
    assert "position_offset" in fields  # with it, the prompt's length (the prompt budget it reserves)
    config = transformers.LlamaConfig()
    assert hasattr(config, "_attn_implementation_internal")  # set directly by serving/batching.py


def test_the_declared_range_is_checked(monkeypatch):
    version.check_serving_transformers(transformers.__version__)  # the installed one is inside it
    version.check_serving_transformers("5.25.0")  # the newest release tested
    with pytest.raises(ImportError, match="OSCAR_SERVING_ANY_TRANSFORMERS"):
        version.check_serving_transformers("5.26.0")
    with pytest.raises(ImportError):
        version.check_serving_transformers("5.16.2")
    with pytest.raises(ImportError, match="5.18"):  # inside the range, not followed
        version.check_serving_transformers("5.18.0")
    version.check_serving_transformers("5.19.0")
    monkeypatch.setenv("OSCAR_SERVING_ANY_TRANSFORMERS", "1")
    version.check_serving_transformers("6.0.0")


def test_the_serving_extra_pins_the_declared_range():
    import configparser
    from pathlib import Path

    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).resolve().parents[2] / "setup.cfg")
    lo, hi = version.SERVING_TRANSFORMERS
    for extra in ("serving", "dev"):
        lines = cfg["options.extras_require"][extra].split()
        pin = ",".join([f"transformers[serving]>={lo}", f"<{hi}"] + [f"!={x}.*" for x in version.SERVING_EXCLUDED])
        assert pin in lines, (extra, lines)


def test_an_unfollowed_release_is_refused_before_any_internal_is_imported():
    import subprocess
    import sys

    code = ("import sys, transformers; transformers.__version__ = '5.16.2'\n"
            "try:\n    import oscar_hf.serving\nexcept ImportError as e:\n    print(e)\n"
            "print('batching' in str(sorted(m for m in sys.modules if m.startswith('oscar_hf.serving'))))")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=300).stdout
    assert "this is 5.16.2" in out and 'pip install "oscar-hf[serving]"' in out, out
    assert out.strip().endswith("False"), out  # oscar_hf.serving.batching (and the internals it reads) not imported
