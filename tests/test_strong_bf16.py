"""benchmarks/strong_bf16.py, the strong BF16 baseline: its decode reads see exactly the live rows, and through
``generate`` (the compiled route, one graph for every step) it gives BF16 ``DynamicCache``'s greedy tokens on
SmolLM2. On the CPU the split kernel runs under the Triton interpreter; the ``gpu`` test runs it compiled."""
import importlib.util
import sys

import pytest
import torch
from script_utils import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))
import strong_bf16  # noqa: E402  (one module name: it registers a custom op)

sys.path.pop(0)

READS = ("split", "flex")
# the split kernel runs compiled on CUDA tensors, under the interpreter on CPU tensors (conftest sets it without a GPU)
DEVICE = "cpu" if strong_bf16.INTERPRETED or not torch.cuda.is_available() else "cuda"


def _case(b, hq, hk, d, cap, n, device="cpu", dtype=torch.float32):
    g = torch.Generator(device="cpu").manual_seed(b * 1000 + cap + n)
    q, k, v = (torch.randn(b, h, t, d, generator=g) for h, t in ((hq, 1), (hk, cap), (hk, cap)))
    # rows past the live length: a read that took them would be dominated by them
    k[:, :, n:], v[:, :, n:] = 50.0, 1e3
    return [x.to(device, dtype) for x in (q, k, v)] + [torch.tensor(n, device=device)]


@pytest.mark.parametrize("read", READS)
@pytest.mark.parametrize("shape", [(2, 8, 2, 64, 300, 257), (1, 9, 3, 64, 100, 1), (1, 4, 4, 32, 1000, 700),
                                   (3, 32, 8, 128, 200, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_reads_the_live_rows_only(read, shape, dtype):
    q, k, v, n = _case(*shape, device=DEVICE, dtype=dtype)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k[:, :, : int(n)].float(),
                                                           v[:, :, : int(n)].float(), enable_gqa=True).transpose(1, 2)
    out = strong_bf16.DECODE[read](q, k, v, n, q.shape[-1] ** -0.5)
    assert out.shape == ref.shape and out.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.slow
@pytest.mark.parametrize("read", READS)
def test_generate_tokens_equal_dynamic_cache(smollm2, read):
    if read == "split" and not strong_bf16.INTERPRETED:
        pytest.skip("the split kernel reads CPU tensors under the Triton interpreter only")
    """Greedy tokens of DynamicCache, through generate's compiled route (dynamo, eager backend on the CPU): one
    graph serves every decode step, so the live length is read on the device, not baked in."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig, DynamicCache

    from oscar_hf.compat import cache_kwargs

    model, tok = smollm2
    ids = tok("The history of the city begins in the twelfth century, when a small market grew around the bridge.",
              return_tensors="pt").input_ids
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    ref = model.generate(ids, **kw, **cache_kwargs(model, DynamicCache(config=model.config)))
    before = model.config._attn_implementation  # (another test of the session's model may have left OSCAR's)
    cc = CompileConfig(fullgraph=True, backend="eager", mode=None)
    cc._compile_all_devices = True
    cache = strong_bf16.StrongBF16Cache(model, ids.shape[1] + 6, read=read)
    counters.clear()
    try:
        out = model.generate(ids, **kw, compile_config=cc, **cache_kwargs(model, cache))
    finally:
        strong_bf16.restore(model)
    assert model.config._attn_implementation == before
    # With the Hub's `kernels` package installed (Transformers >= 5.25 pulls it in), its layer hook's ContextVar is
    # None at a process's first compiled forward and set after it: dynamo's guard on it fails once per process
    hub_kernels = importlib.util.find_spec("kernels") is not None
    assert counters["stats"]["unique_graphs"] <= 1 + hub_kernels, counters["stats"]
    assert int(cache.length) == ids.shape[1] + 5  # the last token is never fed back
    assert out[0, ids.shape[1]:].tolist() == ref[0, ids.shape[1]:].tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("read", READS)
@pytest.mark.parametrize("shape", [(1, 32, 8, 128, 100_064, 100_000), (8, 32, 8, 128, 32_832, 32_769),
                                   (2, 64, 8, 64, 4160, 1000)])
def test_decode_gpu(read, shape):
    q, k, v, n = _case(*shape, device="cuda", dtype=torch.bfloat16)
    ref = strong_bf16.reference_decode(q.float(), k.float(), v.float(), n, q.shape[-1] ** -0.5)
    fn = strong_bf16.split_decode if read == "split" else torch.compile(strong_bf16.flex_decode, fullgraph=True)
    out = fn(q, k, v, n, q.shape[-1] ** -0.5)
    assert (out.float() - ref).abs().max().item() < 2e-2
