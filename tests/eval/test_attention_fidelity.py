"""Attention fidelity: zero for an exact method, positive and growing with quantized history."""
import torch

from oscar_hf.eval.attention_fidelity import fidelity
from oscar_hf.eval.methods import get_method

from tiny_models import tiny_model


def test_fidelity_zero_for_exact_and_positive_for_int2():
    model = tiny_model("llama", initializer_range=0.2)
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (128,))
    methods = {"wide windows": get_method("identity", sink=64, recent=128, group_size=16),
               "int2": get_method("identity", sink=2, recent=4, group_size=16)}
    res = fidelity(model, ids, methods, lengths=(32, 128), n_queries=4, progress=False)
    assert max(res["wide windows"][128]["kl"]) < 1e-6  # nothing quantized: identical attention
    assert min(res["int2"][128]["kl"]) > 0 and min(res["int2"][128]["rel_err"]) > 0
    assert len(res["int2"][32]["kl"]) == model.config.num_hidden_layers
