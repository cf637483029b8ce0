"""method="auto"'s end-to-end check: next-token KL through the cache over whole artifacts, lowest wins."""
import pytest
import torch

from oscar_hf import OscarRotations, calibrate
from oscar_hf.calibration.selection import SCORED_TOKENS, next_token_kl

from tiny_models import tiny_model


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return tiny_model("llama", head_dim=64)


def test_next_token_kl_is_zero_without_quantized_history_and_grows_with_error(tiny):
    ids = torch.randint(1, 200, (700,), generator=torch.Generator().manual_seed(1))
    eye, had = (OscarRotations.builtin(tiny, m) for m in ("identity", "hadamard"))
    # recent covers the whole prompt but one token: one quantized row, a tiny KL
    assert next_token_kl(tiny, had, ids, sink=4, recent=700 - SCORED_TOKENS - 5) < 1e-4
    kl_had = next_token_kl(tiny, had, ids, sink=4, recent=8)
    assert kl_had > 0
    with pytest.raises(ValueError, match="longer than sink"):
        next_token_kl(tiny, had, ids[:600], sink=64, recent=256)


def test_auto_keeps_the_artifact_with_the_lowest_kl(tiny):
    ids = torch.randint(1, 200, (3, 600), generator=torch.Generator().manual_seed(0))
    kw = dict(window=(4, 8), progress=False, retrieval_probes=0)
    rot = calibrate(tiny, None, ids, method="auto", **kw)
    sel = rot.metadata["selection"]
    assert set(sel["kl"]) == {"auto", "oscar", "pca-kv", "hadamard"}
    assert sel["chosen"] == min(sel["kl"], key=sel["kl"].get)
    plain = calibrate(tiny, None, ids, method="auto", select_by_kl=False, **kw)
    assert "selection" not in plain.metadata
    if sel["chosen"] == "auto":  # the held-out error's pick, as without the check
        assert all(torch.equal(rot.layers[i].r_k, plain.layers[i].r_k) for i in rot.layers)
    else:  # one candidate everywhere
        names = {n for heads in rot.metadata["winners"]["k"].values() for n in heads}
        assert names == {sel["chosen"]}
    # the KL recorded is the chosen artifact's own
    held = ids[-1]
    assert next_token_kl(tiny, rot, held, sink=4, recent=8) == pytest.approx(sel["kl"][sel["chosen"]], rel=1e-5)


def test_auto_short_windows_keep_the_heldout_pick(tiny):
    ids = torch.randint(1, 200, (3, 300), generator=torch.Generator().manual_seed(2))
    rot = calibrate(tiny, None, ids, method="auto", window=(4, 8), progress=False, retrieval_probes=0)
    assert "selection" not in rot.metadata
