"""The proxy-ranking eval's pieces: the rank correlation and the per-layer output errors."""
import pytest
import torch

from oscar_hf import OscarRotations
from oscar_hf.eval.attention_fidelity import capture_qkv
from oscar_hf.eval.methods import OscarFamily
from oscar_hf.eval.proxy_ranking import fake_quant_kl, full_log_probs, output_errors, spearman

from tiny_models import tiny_model


def test_spearman_orders_and_ties():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3], [1, 100, 2]) == pytest.approx(0.5)  # one swap of three
    assert spearman([1, 1, 2], [5, 5, 9]) == pytest.approx(1.0)  # ties share their rank


def test_output_errors_zero_when_exact_and_grow_with_quantization():
    model = tiny_model("llama", head_dim=64)
    ids = torch.randint(1, 200, (96,), generator=torch.Generator().manual_seed(0))
    cap = capture_qkv(model, ids)
    rot = OscarRotations.builtin(model, "hadamard")
    exact = OscarFamily("x", rotations=rot, sink=8, recent=200, group_size=64).fake_spec(model)  # nothing quantized
    quant = OscarFamily("q", rotations=rot, sink=0, recent=1, group_size=64).fake_spec(model)
    pos = range(80, 96)
    assert output_errors(model, cap, exact, pos) == pytest.approx((0.0, 0.0), abs=1e-6)
    out_e, proj_e = output_errors(model, cap, quant, pos)
    assert out_e > 0.01 and proj_e > 0.01
    assert fake_quant_kl(model, ids, exact) == pytest.approx(0.0, abs=1e-6)
    kl = fake_quant_kl(model, ids, quant)
    assert kl > 0
    assert fake_quant_kl(model, ids, quant, full_log_probs(model, ids)) == pytest.approx(kl)
