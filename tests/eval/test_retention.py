"""The verbatim-retention probe (recall after the window flush) and the windows check, on SmolLM2 (CI-sized: a
short prefix, windows of 4 / 48, 52 generated tokens, so the passage goes from the recent window to the history)."""
from __future__ import annotations

import pytest
from transformers import DynamicCache

from oscar_hf import OscarCache, OscarConfig
from oscar_hf.eval.retention import PASSAGES, WindowsError, check_windows, probe

from tiny_models import tiny_model

SINK, RECENT, TOKENS, PREFIX = 4, 48, 52, 8


class ForgetfulCache(DynamicCache):
    """BF16 rows, but a row that leaves the last ``recent`` tokens (after the first ``sink``) is zeroed: the failure
    the probe exists for (recent rows that do not survive the window flush)."""

    def __init__(self, config, sink, recent):
        super().__init__(config=config)
        self.sink, self.recent = sink, recent

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        t = k.shape[-2]
        if t > self.sink + self.recent:
            k[..., self.sink:t - self.recent, :] = 0
            v[..., self.sink:t - self.recent, :] = 0
        return k, v


@pytest.mark.slow
def test_probe_bf16_recalls_and_a_cache_that_loses_flushed_rows_does_not(smollm2):
    model, tok = smollm2
    methods = {"bf16": lambda: DynamicCache(config=model.config),
               "forgetful": lambda: ForgetfulCache(model.config, SINK, RECENT),
               "oscar": lambda: OscarCache(model, method="hadamard", sink=SINK, recent=RECENT)}
    res = probe(model, tok, methods, PASSAGES[:1], tokens=TOKENS, prefix=PREFIX)
    e = res["passages"][0]
    p0, p1 = e["passage_slots"]
    # the layout the probe promises: in the recent window at prefill, wholly in the history at the cue
    assert p0 >= e["prefill_len"] - RECENT and p1 <= e["cue_at"] - RECENT and p1 - p0 >= 35
    assert len(e["continuation"].split()) >= 20
    bf16, forgetful = e["methods"]["bf16"], e["methods"]["forgetful"]
    assert bf16["exact"] and bf16["words_correct"] == bf16["words"] >= 35
    assert bf16["recalled"].startswith(e["passage"])
    assert not forgetful["exact"] and forgetful["words_correct"] < bf16["words_correct"] // 2
    oscar = e["methods"]["oscar"]  # scored, whatever it is (artifact-free INT2 at tiny windows)
    assert 0 <= oscar["words_correct"] <= oscar["words"] and e["windows"]["oscar"]["cache"] == (SINK, RECENT)
    assert res["summary"]["bf16"] == {"exact": 1, "words_correct": bf16["words"], "words": bf16["words"],
                                      "passages": 1}
    # the run repeated from its stored continuation: the same tokens, no sampling, the same scores
    assert e["seed"] == 0 and len(e["continuation_ids"]) == TOKENS
    again = probe(model, tok, {"oscar": methods["oscar"]}, PASSAGES[:1], tokens=TOKENS, prefix=PREFIX,
                  continuations=[e["continuation_ids"]])["passages"][0]
    assert again["continuation_ids"] == e["continuation_ids"] and again["seed"] is None
    assert {k: again["methods"]["oscar"][k] for k in ("recalled", "words_correct")} == \
        {k: oscar[k] for k in ("recalled", "words_correct")}


@pytest.mark.slow
def test_probe_refuses_a_layout_that_does_not_flush_the_passage(smollm2):
    model, tok = smollm2
    few = {"oscar": lambda: OscarCache(model, method="hadamard", sink=SINK, recent=RECENT)}
    with pytest.raises(ValueError, match="still in the recent window"):
        probe(model, tok, few, PASSAGES[:1], tokens=RECENT - 10, prefix=PREFIX)
    with pytest.raises(ValueError, match="continuations: expected 1 lists of 52 token ids"):
        probe(model, tok, few, PASSAGES[:1], tokens=TOKENS, prefix=PREFIX, continuations=[[1] * (TOKENS - 1)])
    narrow = {"oscar": lambda: OscarCache(model, method="hadamard", sink=SINK, recent=32)}  # < the passage's tokens
    with pytest.raises(ValueError, match="not inside the recent window at prefill"):
        probe(model, tok, narrow, PASSAGES[:1], tokens=TOKENS, prefix=PREFIX)


@pytest.fixture(scope="module")
def tiny_and_chosen():
    model = tiny_model("llama")
    rot = OscarCache(model, method="hadamard").rotations
    rot.metadata["settings"] = {"chosen": {"sink": 8, "recent": 32, "group_size": 32}}
    return model, rot


def test_check_windows_accepts_the_artifacts_windows_or_larger(tiny_and_chosen):
    model, rot = tiny_and_chosen
    info = check_windows(OscarCache(model, rot))
    assert info["chosen"] == (8, 32) and info["cache"] == (8, 32)
    assert check_windows(OscarCache(model, rot, OscarConfig(group_size=32)))["cache"] == (64, 256)  # larger: fine
    assert check_windows(OscarCache(model, method="hadamard", recent=16))["chosen"] is None  # no artifact choice


def test_check_windows_refuses_smaller_windows_than_the_artifact_chose(tiny_and_chosen):
    model, rot = tiny_and_chosen
    with pytest.raises(WindowsError, match="artifact chose sink 8 / recent 32"):
        check_windows(OscarCache(model, rot, recent=16))
    with pytest.raises(WindowsError, match="artifact chose"):
        check_windows(OscarCache(model, rot, OscarConfig(sink=0, recent=32, group_size=32)))
    with pytest.warns(RuntimeWarning, match="OSCAR windows are off"):
        check_windows(OscarCache(model, rot, recent=16), strict=False)


def test_check_windows_refuses_layers_that_disagree_with_the_cache(tiny_and_chosen):
    model, _ = tiny_and_chosen
    cache = OscarCache(model, method="hadamard", sink=8, recent=32)
    layer = next(x for x in cache.layers if hasattr(getattr(x, "config", None), "recent"))
    layer.config = layer.config.replace(recent=4)  # one layer built with other windows
    with pytest.raises(WindowsError, match="keep sink 8 / recent 4"):
        check_windows(cache)
