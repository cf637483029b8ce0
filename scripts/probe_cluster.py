"""Feasibility probe (session 27, GPU only): can a Triton-compiled kernel run as thread-block clusters and exchange
values through distributed shared memory, on this machine's Triton?

Why: the B=1 decode op waits ~2-3 us for a global-memory handoff of the rotated query (``benchmarks/README_kernels.md``,
sessions 24-27); history programs of one KV head grouped in a cluster could share it through DSMEM instead. Triton
compiles cluster launches only with ``num_ctas > 1``, whose layouts split tensors across the CTAs; this probe keeps
``num_ctas = 1`` and launches the compiled function itself through the driver (``cuLaunchKernelEx`` with a cluster
dimension, via ctypes), the exchange in one inline-PTX block (a static ``.shared`` word per lane, ``barrier.cluster``,
``mapa`` + ``ld.shared::cluster`` of the next rank's word). It checks the values eagerly, under programmatic dependent
launch and replayed from a CUDA graph, and times two exchanges in a row (``%globaltimer`` around each; the first
also waits for the cluster's last CTA to start).

    python3 scripts/probe_cluster.py --out probe_cluster.json
"""
import argparse
import ctypes
import json
import re
import sys

import torch
import triton
import triton.language as tl

from oscar_hf.kernels.query_triton import stamp_asm  # (%globaltimer once its int32 input is known)

# own value into a static .shared word per lane, cluster barrier, the next rank's word through DSMEM, barrier again
# (so that no CTA exits while a peer may still read its shared memory); $0 = that word
_EXCHANGE = tl.constexpr(
    "{ .reg .u32 a, r, n, p, v; .shared .align 4 .b32 xbuf${:uid}[32]; "
    "mov.u32 r, %cluster_ctarank; mov.u32 n, %cluster_nctarank; "
    "mov.u32 a, xbuf${:uid}; mov.u32 v, %laneid; shl.b32 v, v, 2; add.u32 a, a, v; "
    "st.shared.u32 [a], $1; barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned; "
    "add.u32 p, r, 1; rem.u32 p, p, n; mapa.shared::cluster.u32 a, a, p; ld.shared::cluster.u32 $0, [a]; "
    "barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned; }")


@triton.jit
def _probe(OUT, OUT2, TIMES):
    i = tl.arange(0, 32)
    v = tl.program_id(0) * 100 + i
    t0 = stamp_asm(v)
    w = tl.inline_asm_elementwise(_EXCHANGE, "=r,r", [v + (t0 * 0).to(tl.int32)], dtype=tl.int32, is_pure=False,
                                  pack=1)
    t1 = stamp_asm(w)
    # a second exchange, the cluster's CTAs now in step (the first one also waits for the last of them to start)
    w2 = tl.inline_asm_elementwise(_EXCHANGE, "=r,r", [w + (t1 * 0).to(tl.int32)], dtype=tl.int32, is_pure=False,
                                   pack=1)
    t2 = stamp_asm(w2)
    tl.store(OUT + tl.program_id(0) * 32 + i, w)
    tl.store(OUT2 + tl.program_id(0) * 32 + i, w2)
    tl.store(TIMES + tl.program_id(0) * 3 + i * 0, t0, mask=i == 0)
    tl.store(TIMES + tl.program_id(0) * 3 + 1 + i * 0, t1, mask=i == 0)
    tl.store(TIMES + tl.program_id(0) * 3 + 2 + i * 0, t2, mask=i == 0)


class _Attr(ctypes.Structure):  # CUlaunchAttribute: id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint32 * 16)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attr)), ("numAttrs", ctypes.c_uint)]


CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


def launch_clusters(kernel, grid, cluster, args, pdl=False):
    """``kernel`` (a Triton CompiledKernel, num_ctas 1) on the current stream as clusters of ``cluster`` CTAs along x:
    ``args`` are the kernel's own parameters (pointers / ints as Python ints); the PTX entry's further parameters
    (Triton's scratch pointers) get 0."""
    cuda = ctypes.CDLL("libcuda.so.1")
    kernel._init_handles()
    entry = re.search(r"\.entry\s+\w+\s*\(([^)]*)\)", kernel.asm["ptx"], re.S).group(1)
    kinds = re.findall(r"\.param\s+\.(\w+)", entry)
    vals = list(args) + [0] * (len(kinds) - len(args))
    holders = [(ctypes.c_uint64 if k in ("u64", "b64", "s64") else ctypes.c_uint32)(v) for k, v in zip(kinds, vals)]
    params = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
    attrs = (_Attr * 2)()
    attrs[0].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attrs[0].value[0], attrs[0].value[1], attrs[0].value[2] = cluster, 1, 1
    attrs[1].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attrs[1].value[0] = 1
    cfg = _Config(grid[0], grid[1], grid[2], 32 * kernel.metadata.num_warps, 1, 1, kernel.metadata.shared,
                  ctypes.c_void_p(torch.cuda.current_stream().cuda_stream), attrs, 2 if pdl else 1)
    err = cuda.cuLaunchKernelEx(ctypes.byref(cfg), ctypes.c_void_p(kernel.function), params, None)
    if err != 0:
        raise RuntimeError(f"cuLaunchKernelEx: CUresult {err}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="probe_cluster.json")
    args = ap.parse_args()
    n, cl = 1024, 4
    out = torch.zeros(n, 32, device="cuda", dtype=torch.int32)
    out2 = torch.zeros_like(out)
    times = torch.zeros(n, 3, device="cuda", dtype=torch.int64)
    kernel = _probe[(1,)](out, out2, times, num_warps=1)  # (compiles; one program, a cluster of one)
    pid = torch.arange(n, device="cuda")[:, None]
    lane = torch.arange(32, device="cuda")[None, :]
    want = ((pid // cl) * cl + (pid % cl + 1) % cl) * 100 + lane
    want2 = ((pid // cl) * cl + (pid % cl + 2) % cl) * 100 + lane  # (the next rank's word: its next rank's)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "command": " ".join(sys.argv), "programs": n, "cluster": cl}
    for name, pdl in (("eager", False), ("eager_pdl", True)):
        out.zero_()
        out2.zero_()
        launch_clusters(kernel, (n, 1, 1), cl, (out.data_ptr(), out2.data_ptr(), times.data_ptr()), pdl=pdl)
        torch.cuda.synchronize()
        res[name] = bool(torch.equal(out, want) and torch.equal(out2, want2))
        for j, what in ((1, "first"), (2, "second")):
            t = (times[:, j] - times[:, j - 1]).double().sort().values / 1e3
            res[f"{name}_{what}_exchange_us_p50"] = float(t[n // 2])
            res[f"{name}_{what}_exchange_us_max"] = float(t[-1])
        print(name, {k: v for k, v in res.items() if k.startswith(name)}, flush=True)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            launch_clusters(kernel, (n, 1, 1), cl, (out.data_ptr(), out2.data_ptr(), times.data_ptr()), pdl=True)
    ok = True
    for _ in range(3):
        out.zero_()
        out2.zero_()
        g.replay()
        torch.cuda.synchronize()
        ok &= bool(torch.equal(out, want) and torch.equal(out2, want2))
    res["graph"] = ok
    print("graph", ok, flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
