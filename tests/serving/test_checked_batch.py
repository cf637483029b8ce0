"""Checked, never silent: every step compares the requests the OSCAR cache recorded (Transformers' per-request
hooks, the only place the store learns whose rows are whose) with the ones Transformers packed into the forward, and
raises on any difference; a layer the store leaves in BF16 is named once."""
import logging

import pytest
import torch
from transformers import GenerationConfig

from oscar_hf.serving import OscarPagedCache, continuous_batching_config, paged_oscar

OSCAR = dict(sink=4, recent=8, group_size=32)
PROMPTS = [[5, 9, 33, 2, 71, 8, 100, 4, 19, 60, 3, 17, 44, 81], [7, 7, 21, 90, 12, 6, 30, 2, 9, 11, 13, 15]]


def run(model):
    gen_cfg = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb_cfg = continuous_batching_config(num_blocks=64, max_batch_tokens=128, page_size=8)
    with paged_oscar(model, **OSCAR):
        out = model.generate_batch(PROMPTS, gen_cfg, continuous_batching_config=cb_cfg, warmup=False)
    return list(out.values())


def test_served_as_recorded(model):
    assert all(r.error is None and len(r.generated_tokens) == 6 for r in run(model))


@pytest.mark.parametrize("drift", ["missed", "reordered", "length"])
def test_a_recording_that_drifts_from_the_packed_rows_raises(model, monkeypatch, drift):
    record = OscarPagedCache._record

    def drifting(self, request_id, past_length, query_length):
        if drift == "missed" and past_length > 0:  # the hook not called for a decode row
            return
        if drift == "length":
            past_length += 1
        record(self, request_id, past_length, query_length)
        if drift == "reordered" and len(self._pending) == 2:
            self._pending.reverse()

    monkeypatch.setattr(OscarPagedCache, "_record", drifting)
    out = run(model)
    assert all(r.error is not None and "the cache recorded" in r.error for r in out), [r.error for r in out]


def test_a_layer_left_in_bf16_is_named_once(model, caplog):
    gen_cfg = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb_cfg = continuous_batching_config(num_blocks=64, max_batch_tokens=128, page_size=8)
    with caplog.at_level(logging.WARNING, logger="oscar_hf"):
        with paged_oscar(model, num_pages=32, page_size=8, skip_layers=[1], **OSCAR):
            model.generate_batch(PROMPTS, gen_cfg, continuous_batching_config=cb_cfg, warmup=False)
            model.generate_batch(PROMPTS, gen_cfg, continuous_batching_config=cb_cfg, warmup=False)
    named = [r.getMessage() for r in caplog.records if "BF16" in r.getMessage()]
    assert len(named) == 1 and "[1]" in named[0], named
