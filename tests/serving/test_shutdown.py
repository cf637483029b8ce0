"""A manager stopped while its loop still flushes (``transformers serve`` stops the old model's manager with a 2 s
timeout on a model switch) releases everything once the loop is over: the store's requests, window slots and pages,
and the model's attention name, so that the next manager of the model starts and serves."""
import time

from transformers import GenerationConfig

from oscar_hf.serving import SECTOR_API, continuous_batching_config, paged_oscar

OSCAR = dict(sink=4, recent=8, group_size=32)


def gen_config(n):
    return GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)


def until(predicate, timeout=120.0) -> bool:
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_manager_stopped_while_flushing_releases_everything_after_its_loop(model, monkeypatch):
    import threading

    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor

    held, go = threading.Event(), threading.Event()  # the loop waits at its next step while the test stops it
    prepare = ContinuousBatchProcessor.prepare_next_batch

    def gated(self):
        if held.is_set():
            go.wait(timeout=300)
        return prepare(self)

    monkeypatch.setattr(ContinuousBatchProcessor, "prepare_next_batch", gated)
    cb_cfg = continuous_batching_config(num_blocks=64, max_batch_tokens=64, page_size=8)
    with paged_oscar(model, max_requests=4, **OSCAR) as store:
        manager = model.init_continuous_batching(generation_config=gen_config(3), continuous_batching_config=cb_cfg)
        manager.start()
        rid = manager.add_request(list(range(5, 30)), max_new_tokens=300)
        assert until(lambda: store.requests)  # it decodes
        loop = manager._generation_thread
        held.set()
        manager.stop(block=True, timeout=0.01)  # returns while the loop is still at work
        assert loop.is_alive()
        assert store.windows.nbytes > 0 and store.has_pool  # the loop's requests still read the store
        if SECTOR_API:  # (5.17 - 5.19: Transformers' own stop puts the model back on the name it found at once)
            assert model.config._attn_implementation == "oscar_sdpa"
        go.set()
        # (Transformers' stop drops the batch processor while the loop still runs: the flushing request then fails
        # with "Tried to perform a generation step before the batch processor was initialized", BF16 alike)
        assert manager.get_result(rid, timeout=300) is not None
        loop.join(timeout=300)
        assert until(lambda: store.windows.nbytes == 0 and store.pool.released, timeout=30), store.stats()
        assert not store.requests and model.config._attn_implementation == "sdpa"
        again = model.init_continuous_batching(generation_config=gen_config(3), continuous_batching_config=cb_cfg)
        again.start()
        rid = again.add_request([3, 1, 4, 1, 5, 9, 2, 6], max_new_tokens=3)
        assert len(again.get_result(rid, timeout=120).generated_tokens) == 3
        again.stop(block=True)
        assert store.windows.nbytes == 0 and store.pool.released
