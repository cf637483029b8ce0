"""Where the kernels run (:func:`triton_enabled`) and their named defaults (:class:`DecodeDefaults`,
:class:`HeadsDefaults`, :class:`WriteDefaults`; the launchers take ``defaults=``). The measured reason for each
value: docs/kernels.md §4. Plain Python and torch only (no Triton import)."""
from __future__ import annotations

import dataclasses
import os

import torch

_TRITON_IMPORTABLE: bool | None = None  # a plain global, not functools.lru_cache: dynamo traces through that cache
# wrapper (re-tracing the import at every call site of every layer)


@torch.compiler.assume_constant_result  # dynamo bakes the answer in: a guard on the global, set during the first
def triton_importable() -> bool:  # trace, would fail at the next call and compile the step a second time
    global _TRITON_IMPORTABLE
    if _TRITON_IMPORTABLE is None:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401  (importable, not only the package)
            _TRITON_IMPORTABLE = True
        except Exception:
            _TRITON_IMPORTABLE = False
    return _TRITON_IMPORTABLE


def settle_cache_keys(namespace: dict) -> None:
    """Compute the Triton cache key of every jit function in ``namespace`` (a kernel module's globals, at the end of
    its import), helpers before their callers: Triton 3.6 merges a called function's constexpr globals into a key
    only if that function's key exists already, so a key depended on which kernel a process launched first."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return
    for value in list(namespace.values()):
        if isinstance(value, JITFunction):  # (not under TRITON_INTERPRET=1: interpreted functions have no key)
            try:
                value.cache_key  # noqa: B018 (computed and kept by Triton)
            except Exception:  # noqa: BLE001 (a kernel Triton cannot key fails at its launch, not at this import)
                pass


def triton_enabled(t: torch.Tensor, use_kernels="auto") -> bool:
    """Whether the Triton path serves tensor ``t``: CUDA (or the interpreter when forced) and triton present."""
    if use_kernels is False:
        return False
    ok = triton_importable() and (t.is_cuda or (use_kernels is True and os.environ.get("TRITON_INTERPRET") == "1"))
    if use_kernels is True and not ok:
        raise RuntimeError(
            "use_kernels=True but the Triton kernels cannot run here "
            f"(triton importable: {triton_importable()}, device: {t.device}); install `triton` and use a CUDA device, "
            "or set use_kernels='auto'.")
    return ok


@dataclasses.dataclass(frozen=True)
class DecodeDefaults:
    """Tunables of the decode read path (figures, alternatives that lost: docs/kernels.md, "Why the defaults")."""

    # split kernel: the tile of the default shape (D = 128, <= 16 query rows per KV head), best of the tile sweep
    block_n: int = 64  # history tokens per inner-loop step
    num_warps: int = 4
    num_stages: int = 4
    # register cap of the deferred loop: 3 programs an SM, faster than 2 uncapped or 4 under 128 (None: no cap)
    maxnreg: int | None = 168
    block_n_other: int = 64  # other head_dims or > 16 query rows (larger tiles spill registers)
    # D > 128, 64 query rows, or per-channel metadata: 8 warps keep the tiles in registers
    num_warps_wide: int = 8
    num_warps_wide_deferred: int = 4  # ... but D > 128 on the deferred loop: 4 warps, twice as fast
    num_stages_wide: int = 2  # D > 128
    # D = 512: the smallest tiles that do not spill (tests/kernels/test_compile_sm90.py); GPU time not measured yet
    block_n_xwide: int = 16
    num_warps_xwide: int = 8  # (INT8 / 16 bits; INT4 keeps its 4)
    merge_block_xwide: int = 32
    # split-K: the wave model of num_splits
    max_waves: int = 4  # at most this many waves of programs (more splits: more partials to merge)
    min_split: int = 256  # never fewer history tokens than this per split
    win_split: int = 128  # window tokens per window program
    # combine kernel (latency-bound: few programs, each a chain of dependent loads)
    merge_block: int = 128  # split partials merged per step
    merge_block_few: int = 256  # where the combine has fewer rows than SMs: all of a row's splits in one round
    merge_hoist_win: int = 16  # R_V's chunks and the window partials loaded with the history's up to this many
    merge_one_warp_rows: int = 4  # one warp per query row from this many rows per SM on
    merge_out_parts: int = 4  # programs per row where rows are fewer than SMs, each un-rotating 1/4 of R_V's rows
    merge_warps_few: int = 4  # their warps (at D = 128 with a row's splits in one tile of <= 128)
    splits_pow2_slack: float = 0.05  # few rows: splits rounded down to a power of two (a full combine tile)
    # Gluon history kernel (decode_gluon.gluon_supported): ~12 SASS instructions a history token against ~32
    gluon_min_work: int = 500_000  # history tokens x (row, KV head) from which it pays for its extra launch
    gluon_resident: int = 12  # one-warp programs resident per SM under gluon_maxnreg (the wave model's slots)
    gluon_maxnreg: int = 168  # 12 programs an SM were faster than 13-14 without the cap's small spills
    gluon_stages: int = 2  # cp.async pipeline stages of short splits (a deeper pipeline's start costs them more)
    # long splits (>= gluon_long_split tokens): int8 key MMAs, 4 stages, 8 programs an SM uncapped
    gluon_long_split: int = 256
    gluon_stages_long: int = 4
    gluon_resident_long: int = 8
    gluon_maxnreg_long: int = 255
    # window programs on the Gluon path where programs are few (<= 8 per SM)
    gluon_win_split: int = 64
    gluon_win_stages: int = 2
    # D = 256: fp16 keys at every split length, 8 programs an SM uncapped
    gluon_maxnreg_wide: int = 255
    gluon_resident_wide: int = 8


DEFAULTS = DecodeDefaults()


@dataclasses.dataclass(frozen=True)
class HeadsDefaults:
    """Tunables of the retrieval heads' read (docs/kernels.md, section 3.9)."""

    block_n: int = 32  # slots per inner step
    num_warps: int = 4  # INT8 / 16-bit codes: the sweep's best tile with block_n
    num_stages: int = 3
    num_warps_int4: int = 4  # INT4: two planes per block, more registers
    num_stages_int4: int = 2
    min_split: int = 256  # never fewer history slots per split
    max_waves: int = 4
    resident: int = 3  # split programs an SM holds at once (the wave model's slots)
    merge_block: int = 64  # partials merged per step of the combine
    # D = 512: what fits shared memory and registers (tests/kernels/test_compile_sm90.py); GPU time not measured yet
    block_n_xwide: int = 32
    num_stages_xwide: int = 2
    num_warps_xwide: int = 8  # (INT8 / 16 bits; INT4 keeps its 4)
    merge_warps_xwide: int = 8
    # CUDA: the two launches on a side stream beside the INT2 heads' (forked and joined inside the layer's read, so a
    # CUDA graph captures them as a parallel branch): their programs fill the SMs the INT2 launches leave idle
    side_stream: bool = True
    # where the INT2 heads' read is the kernels': the split launch alone, its partials merged by the INT2 heads'
    # combine into the layer's output (False: a combine of their own, then a copy of their rows into the output)
    merged: bool = True

    def launch(self, bits: int, d: int = 128) -> tuple[int, int]:
        """``(num_warps, num_stages)`` of the split kernel for ``bits``-bit codes of head_dim ``d``."""
        warps, stages = (self.num_warps_int4, self.num_stages_int4) if bits == 4 else (self.num_warps, self.num_stages)
        if d > 256:  # (INT8 / 16-bit rows of 512 on 4 warps spill 208 bytes: tests/kernels/test_compile_sm90.py)
            return (warps if bits == 4 else self.num_warps_xwide), min(stages, self.num_stages_xwide)
        return warps, stages


HEADS_DEFAULTS = HeadsDefaults()


@dataclasses.dataclass(frozen=True)
class WriteDefaults:
    """Tunables of the compiled layer's one-token write (docs/kernels.md, section 2.1)."""

    # CUDA, batches of at most this many sequences: the new token's put alone before the read and the demotion (the
    # latency-bound part) on a side stream beside it, forked and joined inside the decode op (a parallel branch of the
    # CUDA graph); larger batches: one launch of both before the read. H100, Qwen3-8B shape, generate: B=1 3.5% / 3.0%
    # faster at 100K (without / with 25 INT8 heads), 0.5% at 1K; B=8/32K -0.2% / +1.2%; B=32/32K 2.3% slower
    # (docs/kernels.md §2.1). 0: never split.
    beside_max_batch: int = 8


WRITE_DEFAULTS = WriteDefaults()


# plain Python on purpose: triton.cdiv and next_power_of_2 go through Triton's constexpr wrapper (~1-2 us a call)
def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of non-negative ints (``b > 0``)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def pow2_at_least(n: int, lo: int) -> int:
    return max(lo, next_pow2(n))


def last_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a copy where its last dimension is strided (the kernels read rows of unit stride)."""
    return x if x.stride(-1) == 1 else x.contiguous()
