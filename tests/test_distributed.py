"""Tensor parallelism: per-rank KV-head slicing of the rotations (oscar_hf.distributed) and the torchrun check."""
import json

import pytest
import torch

import oscar_hf.distributed as tpd
from oscar_hf import OscarCache, OscarRotations, StaticOscarCache
from oscar_hf.compat import cache_kwargs
from oscar_hf.config import ModelFingerprint
from oscar_hf.distributed import HeadShard, even_head_shard, slice_layer_rotation, tp_layout, tp_rank_world
from oscar_hf.rotations import LayerRotation
from script_utils import run_under_torchrun
from tiny_models import tiny_model



def distinct_rotation(hk, d, device="cpu", offsets=True):
    """Per-head tensors whose every entry names its head (head h holds values in [h, h+1))."""
    base = torch.arange(hk, dtype=torch.float32, device=device)
    r = base[:, None, None] + torch.rand(hk, d, d, device=device) * 0.5
    mu = (base[:, None] + 0.5 + torch.rand(hk, d, device=device) * 0.25) if offsets else None
    return LayerRotation(r, r + 0.75, 0.9, 0.8, mu, None if mu is None else -mu)


# ------------------------------------------------------------------ pure head arithmetic
@pytest.mark.parametrize("hk,rank,world,want",
                         [(8, 0, 2, (0, 4)), (8, 1, 2, (4, 8)), (8, 3, 4, (6, 8)), (8, 7, 8, (7, 8)), (2, 0, 1, (0, 2))])
def test_even_head_shard(hk, rank, world, want):
    s = even_head_shard(hk, rank, world)
    assert (s.start, s.stop) == want and s.n == want[1] - want[0]


def test_even_head_shard_rejects_uneven_and_bad_rank():
    with pytest.raises(ValueError, match="multiple of the TP size"):
        even_head_shard(6, 0, 4)
    with pytest.raises(ValueError, match="bad tensor-parallel rank"):
        even_head_shard(8, 2, 2)


def test_slice_on_meta_tensors_shapes_and_clips():
    hk, d = 8, 128
    lr = LayerRotation(torch.empty(hk, d, d, device="meta"), torch.empty(hk, d, d, device="meta"), 0.9, 0.7,
                       torch.empty(hk, d, device="meta"), None)
    out = slice_layer_rotation(lr, HeadShard(2, 4), HeadShard(6, 8))
    assert out.r_k.shape == (2, d, d) and out.r_v.shape == (2, d, d) and out.mu_k.shape == (2, d)
    assert out.mu_v is None and (out.clip_k, out.clip_v) == (0.9, 0.7)
    assert out.r_k.device.type == "meta"
    assert lr.r_k.shape[0] == hk  # the artifact itself is not modified


def test_slice_values_pick_the_right_heads():
    hk, d = 8, 16
    lr = distinct_rotation(hk, d)
    out = slice_layer_rotation(lr, HeadShard(4, 6), HeadShard(2, 4))
    torch.testing.assert_close(out.r_k, lr.r_k[4:6], rtol=0, atol=0)
    torch.testing.assert_close(out.mu_k, lr.mu_k[4:6], rtol=0, atol=0)
    torch.testing.assert_close(out.r_v, lr.r_v[2:4], rtol=0, atol=0)
    torch.testing.assert_close(out.mu_v, lr.mu_v[2:4], rtol=0, atol=0)
    assert out.r_k.floor().unique().tolist() == [4.0, 5.0]  # the entries name their heads
    assert out.r_k.is_contiguous() and out.r_k.data_ptr() != lr.r_k.data_ptr()


def test_slice_full_range_is_a_no_op_and_out_of_range_raises():
    lr = distinct_rotation(4, 8)
    assert slice_layer_rotation(lr, HeadShard(0, 4)) is lr
    with pytest.raises(ValueError, match="out of range"):
        slice_layer_rotation(lr, HeadShard(2, 6))
    with pytest.raises(ValueError, match="out of range"):
        slice_layer_rotation(lr, HeadShard(2, 2))


# ------------------------------------------------------------------ detecting the model's TP group
class FakeMesh:
    def __init__(self, sizes, names, coord):
        self.sizes, self.mesh_dim_names, self.coord = sizes, names, coord
        self.ndim = len(sizes)

    def __getitem__(self, name):
        j = self.mesh_dim_names.index(name)
        return FakeMesh((self.sizes[j],), (name,), (self.coord[j],))

    def size(self, dim=None):
        if dim is not None:
            return self.sizes[dim]
        return int(torch.tensor(self.sizes).prod())

    def get_local_rank(self, dim=None):
        assert self.ndim == 1
        return self.coord[0]


def test_tp_rank_world_from_meshes():
    m = torch.nn.Linear(2, 2)
    assert tp_rank_world(m) is None
    m._device_mesh = FakeMesh((1, 1, 4), ("pp", "fsdp", "tp"), (0, 0, 3))  # transformers 5.2x: 3-D mesh
    assert tp_rank_world(m) == (3, 4)
    m._device_mesh = FakeMesh((2,), ("tp",), (1,))  # transformers 5.17: the TP mesh itself
    assert tp_rank_world(m) == (1, 2)
    m._device_mesh = FakeMesh((1, 2, 1), ("pp", "fsdp", "tp"), (0, 1, 0))  # FSDP only: not tensor parallel
    assert tp_rank_world(m) is None


def test_no_tensor_parallel_changes_nothing():
    model = tiny_model("qwen3")
    assert tp_layout(model, 2, 32) is None
    cache = OscarCache(model, method="hadamard", group_size=32)
    assert cache.tp_layout is None
    for i, layer in enumerate(cache.layers):
        assert layer._rotation_cpu is cache.rotations.layers[i]


def test_wrong_head_count_without_tp_still_raises():
    model = tiny_model("qwen3")  # 2 KV heads, head_dim 32
    fp = ModelFingerprint.from_config(model.config)
    rot = OscarRotations(fp, "bad", {i: distinct_rotation(1, 32) for i in range(fp.num_layers)})  # 1 head per layer
    cache = OscarCache(model, rot, group_size=32)
    assert cache.tp_layout is None
    with pytest.raises(ValueError, match="rotations are for kv_heads=1.*kv_heads=2"):
        with torch.no_grad():
            model(torch.arange(8)[None], **cache_kwargs(model, cache))


def fake_tp(monkeypatch, model, rank, world, head_dim, shift=0):
    """Make every k_proj / v_proj weight look like rank ``rank``'s column shard of ``world``."""
    for mod in model.modules():
        for name in ("k_proj", "v_proj"):
            lin = getattr(mod, name, None)
            if isinstance(lin, torch.nn.Linear):
                n = lin.weight.shape[0]
                lin.weight._fake_range = (rank * n // world + shift, n // world, n)
    monkeypatch.setattr(tpd, "_is_dtensor", lambda w: hasattr(w, "_fake_range"))
    monkeypatch.setattr(tpd, "_dim0_range", lambda w: w._fake_range)
    model._device_mesh = FakeMesh((world,), ("tp",), (rank,))


def test_cache_layers_get_this_ranks_heads(monkeypatch):
    model = tiny_model("qwen3", num_key_value_heads=4, num_attention_heads=8)  # head_dim 32
    fp = ModelFingerprint.from_config(model.config)
    rot = OscarRotations(fp, "distinct", {i: distinct_rotation(4, 32) for i in range(fp.num_layers)})
    fake_tp(monkeypatch, model, rank=1, world=2, head_dim=32)
    cache = OscarCache(model, rot, group_size=32)
    lay = cache.tp_layout
    assert (lay.rank, lay.world, lay.source) == (1, 2, "dtensor")
    assert {i: (s.start, s.stop) for i, s in lay.k.items()} == {0: (2, 4), 1: (2, 4)}
    for i, layer in enumerate(cache.layers):
        torch.testing.assert_close(layer._rotation_cpu.r_k, rot.layers[i].r_k[2:4], rtol=0, atol=0)
        torch.testing.assert_close(layer._rotation_cpu.mu_v, rot.layers[i].mu_v[2:4], rtol=0, atol=0)
        assert cache.rotations.layers[i].r_k.shape[0] == 4  # the cache keeps the whole artifact (save())
    # This rank's attention produces 2 heads: the first update is accepted and moves the slice into place.
    k = torch.randn(1, 2, 5, 32)
    layer = cache.layers[0]
    layer.update(k, k)
    torch.testing.assert_close(layer.params.r_k, rot.layers[0].r_k[2:4], rtol=0, atol=0)
    assert layer.num_kv_heads == 2
    json.dumps(lay.to_dict())  # reportable


def test_static_cache_layers_are_sliced_too(monkeypatch):
    model = tiny_model("qwen3", num_key_value_heads=4, num_attention_heads=8)
    fp = ModelFingerprint.from_config(model.config)
    rot = OscarRotations(fp, "distinct", {i: distinct_rotation(4, 32) for i in range(fp.num_layers)})
    fake_tp(monkeypatch, model, rank=0, world=4, head_dim=32)
    cache = StaticOscarCache(model, rot, group_size=32, max_cache_len=64)
    assert cache.tp_layout is not None and cache.tp_layout.world == 4
    for i, layer in enumerate(cache.layers):
        torch.testing.assert_close(layer._rotation_cpu.r_k, rot.layers[i].r_k[0:1], rtol=0, atol=0)


def test_shard_that_splits_a_head_is_refused(monkeypatch):
    model = tiny_model("qwen3", num_key_value_heads=4, num_attention_heads=8)
    fake_tp(monkeypatch, model, rank=1, world=2, head_dim=32, shift=16)
    with pytest.raises(ValueError, match="not a whole number of KV heads"):
        OscarCache(model, method="hadamard", group_size=32)


# ------------------------------------------------------------------ the real thing: torchrun, gloo, DTensor TP
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_tp_check_script_under_torchrun(tmp_path, compiled):
    """Each rank's cache holds its own KV heads, with the same codes and tokens as one process, in the eager storage
    and in the compiled one (generate compiling the decode step through dynamo, one graph per rank). Transformers
    5.17's TP layers register module backward hooks, which dynamo cannot trace: there compile=True refuses clearly."""
    out = tmp_path / "tp.json"
    r = run_under_torchrun("tp_check.py", ["--shape", "tiny", "--layers", "2", "--context", "96", "--sink", "8",
                                           "--recent", "16", "--new-tokens", "6", "--batch", "3", "--pad", "16",
                                           "--out", str(out)] + ["--compile"] * compiled, tmp_path, timeout=300)
    if compiled and r.returncode and "module backward hooks" in r.stderr:
        import transformers
        from packaging.version import Version

        assert Version(transformers.__version__) < Version("5.24"), "the refusal is for older Transformers only"
        assert "OscarCache(compile=True) does not support a model with module backward hooks" in r.stderr
        return
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["ok"] and res["world"] == 2
    for g in res["ranks"]:
        assert g["k_proj_weight"]["type"] == "DTensor" and g["k_proj_weight"]["local_rows"] == 2 * 64
        assert g["cache_heads_per_layer"] == [2]  # 4 KV heads over 2 ranks
        want = [2 * g["rank"], 2 * g["rank"] + 2]
        assert all(list(s) == want for s in g["tp_layout"]["k"].values())
        assert all(v["k"] == 1.0 and v["v"] == 1.0 and v["entries"] > 0 for v in g["history_code_agreement"].values())
        assert g["tp"]["oscar_memory_report"]["history_codes"] > 0
        assert g["tp"]["oscar_compiled_graphs"] == (1 if compiled else 0)
    # float32 on CPU: TP reproduces the single-process tokens exactly, and a wrong slice is caught.
    assert res["oscar_tp_equals_single"] and res["bf16_tp_equals_single"]
    assert res["negative_control_max_code_agreement"] < 0.6


class _Attention(torch.nn.Module):
    """What the base attention function reads from an attention module."""

    num_key_value_groups = 2
    is_causal = True
    training = False


def test_retrieval_heads_follow_the_rank(monkeypatch):
    """Retrieval heads (global KV head ids) are kept by the rank that holds them, as its local ids, and its
    attention equals the same heads' rows of a single-device cache; a rank holding only such heads is refused."""
    model = tiny_model("qwen3", num_key_value_heads=4, num_attention_heads=8)  # head_dim 32
    fp = ModelFingerprint.from_config(model.config)
    rot = OscarRotations(fp, "distinct", {i: distinct_rotation(4, 32) for i in range(fp.num_layers)})
    kw = dict(group_size=32, sink=4, recent=8, retrieval_heads=((0, 1), (0, 3), (1, 2)))
    single = OscarCache(model, rot, **kw)
    fake_tp(monkeypatch, model, rank=1, world=2, head_dim=32)  # this rank: KV heads 2, 3
    cache = OscarCache(model, rot, **kw)
    assert [layer.retrieval_heads for layer in cache.layers] == [(1,), (0,)]  # global (0, 3) -> local 1; (1, 2) -> 0
    gen = torch.Generator().manual_seed(0)
    module = _Attention()
    for past, n in ((0, 30), (30, 1), (31, 1)):  # prompt (history from slot 4 + 8), then two decode steps
        q = torch.randn(1, 8, n, 32, generator=gen)
        k, v = torch.randn(1, 4, n, 32, generator=gen), torch.randn(1, 4, n, 32, generator=gen)
        outs = []
        for c, sl in ((single, slice(0, 4)), (cache, slice(2, 4))):
            handle, _ = c.layers[0].update(k[:, sl], v[:, sl])
            qs = q[:, 2 * sl.start : 2 * sl.stop]
            outs.append(handle.attend(qs, None, 32**-0.5, module, "sdpa"))  # [1, n, Hq of the rank, D]
        torch.testing.assert_close(outs[1], outs[0][:, :, 4:8], rtol=1e-5, atol=1e-6)
    assert cache.layers[0].export_state()["hist_k"].codes.shape[2] > 0 and cache.layers[0].coded_x is not None
    with pytest.raises(NotImplementedError, match="every KV head of rank 1"):
        OscarCache(model, rot, **{**kw, "retrieval_heads": ((0, 2), (0, 3))})
