"""Building blocks of the Gluon history kernel (:mod:`~oscar_hf.kernels.decode_gluon`): layouts, inline PTX, operands.
Each states its layout: the tensor-core operands of ``mma.sync`` (``m16n8k16`` fp16 / bf16, ``m16n8k32`` int8) built in
the registers that hold them, from per-lane loads; the kernel's docstring says how the pieces fit."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from .plan import settle_cache_keys

DF_LIM = gl.constexpr(64.0)  # as in decode_split: largest excess of a column's max over its reference (log2)

MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))

A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA.value, k_width=2))

B_OP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA.value, k_width=2))

# int8 operands of mma.sync m16n8k32 (K8): a register holds 4 consecutive k of one row (A) / one column (B)
A8_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA.value, k_width=4))

B8_OP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA.value, k_width=4))

# [T, 8] key words (4 bytes): lane 4r + c holds words 2c, 2c + 1 (bytes 8c .. 8c + 7) of rows r, r + 8, ... (one
# 8-byte load per row). Codes travel as 32-bit words: uint8 tensors carried through the loop or a branch would be
# kept one byte per register
KLOAD = gl.constexpr(gl.BlockedLayout([1, 2], [8, 4], [1, 1], [1, 0]))

# [T, 8] value words (4 bytes): lane 4r + c holds word r of tokens 2c, 2c + 1 (+ 8 i)
VLOAD = gl.constexpr(gl.BlockedLayout([2, 1], [4, 8], [1, 1], [0, 1]))

# cp.async pipeline (STAGES > 0): copies of 16 bytes a lane (8 for TB = 1's metadata) -- [T, 8 NH] code words,
# [4 TB, 16] metadata words (row j TB + tb: token set tb of key scale, key zero, value scale, value zero) -- into plain
# row-major shared buffers; metadata read back as [16 t', TB] (TB = 2: the token sets on lane bit 1, broadcast over
# the others) and expanded to the logit tile. NH = 2 (TB = 1): metadata [4 x 16 t, 2 words] (row 16 j + t; a lane
# copies two tokens' words, as 4-byte copies: they are not merged), read back per word. CP_META[TB - 1 + 2 (NH - 1)]
CP_CODES = gl.constexpr(gl.BlockedLayout([1, 4], [16, 2], [1, 1], [1, 0]))

CP_META = gl.constexpr((gl.BlockedLayout([1, 2], [4, 8], [1, 1], [1, 0]),
                        gl.BlockedLayout([1, 4], [8, 4], [1, 1], [1, 0]),
                        gl.BlockedLayout([2, 2], [32, 1], [1, 1], [1, 0])))

SMEM3 = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))  # (the layout of one stage)

META3 = gl.constexpr(gl.BlockedLayout([1, 1, 2], [8, 2, 2], [1, 1, 1], [2, 1, 0]))  # [16 t', 2 sets, 4 columns]

_sync = getattr(gl, "thread_barrier", None) or gl.barrier  # (Triton 3.6 / newer)

_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

# Key codes of one 32-bit word ($16, bytes 0..3 of a token row): two prmt put bytes 0, 1 (2, 3) into the low bytes of
# the two 16-bit halves, one lop3 per plane and pair keeps the plane's bits and or-s in 0x6400 (fp16 1024):
# 1024 + 4^P code. Outputs: byte B of plane P in $4P+B (fp16; the halves of the lop3 results, free in registers).
_K_ASM = gl.constexpr(
    "{ .reg .b32 w, x, r0, r1; prmt.b32 w, $16, 0, 0x4140; prmt.b32 x, $16, 0, 0x4342; "
    + " ".join(f"lop3.b32 r0, w, 0x{(3 << 2 * p) * 0x10001:08X}, 0x64006400, 0xEA; "
               f"lop3.b32 r1, x, 0x{(3 << 2 * p) * 0x10001:08X}, 0x64006400, 0xEA; "
               f"mov.b32 {{${4 * p}, ${4 * p + 1}}}, r0; mov.b32 {{${4 * p + 2}, ${4 * p + 3}}}, r1;" for p in range(4))
    + " }")

# K8: plane P of 4 key bytes (one 32-bit word, $1; $2..$4 are copies of it) as 4 int8 operands in one instruction:
# (x & mask_P) ^ flip_P = 4^P code -- plane 3 with its top bit flipped, 64 code - 128, so that it fits int8 (the -128 is
# given back by the accumulator's start)
_K8_ASM = gl.constexpr(tuple(
    f"lop3.b32 $0, $1, 0x{(3 << 2 * p) * 0x01010101:08X}, 0x{0x80808080 if p == 3 else 0:08X}, 0x6A;"
    for p in range(4)))

_RNI_ASM = gl.constexpr("cvt.rni.f32.f32 $0, $1;")  # round to the nearest integer (even on ties)

# Value codes of byte position BB of two tokens' words ($4: token t, $5: token t + 1): prmt pairs the two bytes
# (selector nibble i = source of destination byte i: byte 0 <- byte BB of $4, byte 2 <- byte BB of $5; half 0: token
# t), one lop3 per plane or-s them into 0x4380 (bf16 256, mantissa LSB worth 2): 256 + KP code with KP = 2, 8, 32;
# plane 3's bits would reach the exponent and are shifted down to bits 4-5 first (KP = 32).
_V_ASM = gl.constexpr(tuple(
    f"{{ .reg .b32 w, y; prmt.b32 w, $4, $5, 0x{bb | ((4 + bb) << 8):04X}; shr.b32 y, w, 2; "
    "lop3.b32 $0, w, 0x00030003, 0x43804380, 0xEA; lop3.b32 $1, w, 0x000C000C, 0x43804380, 0xEA; "
    "lop3.b32 $2, w, 0x00300030, 0x43804380, 0xEA; lop3.b32 $3, y, 0x00300030, 0x43804380, 0xEA; }"
    for bb in range(4)))

# Wait until the 32-bit counter at $1 reaches $2 (acquire, GPU scope; QFLAG): poll with a short sleep, trap after
# ~2^22 polls (seconds) rather than hang; $0 is 0, an opaque offset for the loads that must follow the wait
_SPIN_ASM = gl.constexpr(
    "{ .reg .pred p; .reg .u32 v, n; mov.u32 n, 0; "
    "SPIN${:uid}: ld.acquire.gpu.global.u32 v, [$1]; setp.ge.u32 p, v, $2; @p bra DONE${:uid}; "
    "add.u32 n, n, 1; setp.gt.u32 p, n, 4194304; @p trap; nanosleep.u32 32; bra SPIN${:uid}; "
    "DONE${:uid}: mov.u32 $0, 0; }")

LANES = gl.constexpr(gl.BlockedLayout([1], [32], [1], [0]))

# movmatrix.trans on each 8x8 block of a 16-bit accumulator-layout tile (see _w_operand)
_MOVM_ASM = gl.constexpr("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;")


def _lane_loads(vec, offs, strides):
    """PTX (plain, masked) of ``vec * len(offs)`` outputs loaded ``vec`` at a time from ``[ptr + offs[i] * stride]``;
    the operands after the outputs: pointer, then (masked) the lane's bounds lo, hi."""
    n_out = vec * len(offs)
    p, lo, hi = f"${n_out}", f"${n_out + 1}", f"${n_out + 2}"
    plain, masked = [], ["{ .reg .pred p, q;"]
    for i, o in enumerate(offs):
        regs = ", ".join(f"${vec * i + j}" for j in range(vec))
        ld = f"ld.global.v{vec}.b32 {{{regs}}}" if vec > 1 else f"ld.global.b32 {regs}"
        plain.append(f"{ld}, [{p}+{o * strides}];")
        masked += [f"mov.b32 ${vec * i + j}, 0;" for j in range(vec)]
        masked.append(f"setp.gt.s32 p, {hi}, {o}; setp.le.s32 q, {lo}, {o}; and.pred p, p, q; @p {ld}, [{p}+{o * strides}];")
    return " ".join(plain), " ".join(masked + ["}"])


# keys: words 2c, 2c + 1 of rows r + 8i, i < 2 TB (address: row r, byte 8c)
_KLD_ASM = gl.constexpr(sum((_lane_loads(2, [8 * i for i in range(2 * tb)], 32 * nh) for nh in (1, 2) for tb in (1, 2)),
                            ()))

# values: word r of tokens 2c + 8i + j, i < 2 TB, j < 2, output 2i + j (address: token 2c, byte 4r)
_VLD_ASM = gl.constexpr(sum((_lane_loads(1, [8 * i + j for i in range(2 * tb) for j in range(2)], 32 * nh)
                              for nh in (1, 2) for tb in (1, 2)), ()))

# metadata of logit rows r and r + 8 (address: the word of row r's token)
_MLD_ASM = gl.constexpr(sum((_lane_loads(1, [0, 8], 4 * nh) for nh in (1, 2)), ()))


@gluon.jit
def _k_plane(b0, b1, b2, b3):
    """A plane's codes of byte positions 0..3 of each word (``[T, 8 w]`` each) as ``[T, 32 s]``, ``s = 4w + B``."""
    j = gl.join(gl.join(b0, b1), gl.join(b2, b3))  # [T, 8, 2, 2]: t, w, B & 1, B >> 1
    j = gl.permute(j, [0, 1, 3, 2])
    return gl.reshape(j, [j.shape[0], 32])


@gluon.jit
def _k_operand(y, TB: gl.constexpr):
    """Plane tile ``y [16 TB, 32 s]`` (rows ``tb * 16 + t'``, byte ``s``) -> the A operand ``[16 t', 32 TB k]``,
    ``k = tb * 32 + j`` with ``s = 8c + 4kt + 2h + b`` for ``j = 16kt + 8h + 2c + b`` (``sigma_K``). A pure
    renaming of registers (checked at compile time)."""
    y = gl.reshape(y, [TB, 16, 4, 2, 2, 2])  # tb, t', c, kt, h, b
    y = gl.permute(y, [1, 0, 3, 4, 2, 5])  # t', tb, kt, h, c, b
    y = gl.reshape(y, [16, 32 * TB])
    return gl.convert_layout(y, A_OP, assert_trivial=True)


@gluon.jit
def _k8_operand(xk, P: gl.constexpr, TB: gl.constexpr):
    """K8: plane ``P`` of the key words ``xk [16 TB, 8]`` (int32, ``KLOAD``) as the int8 A operand ``[16 t', 32 TB k]``
    of ``m16n8k32``, ``k = 32 tb + 16 hh + 4 c + i`` holding byte ``8 c + 4 hh + i`` of token ``16 tb + t'`` (``sigma8``):
    a lane's words ``2c, 2c + 1`` are its registers, so one ``lop3`` per word and a renaming of registers."""
    x = gl.join(gl.join(xk, xk), gl.join(xk, xk))  # [T, 8, 2, 2]: four copies of each word (one asm instance)
    x = gl.reshape(x, [16 * TB, 32])
    y = gl.inline_asm_elementwise(_K8_ASM[P], "=r,r,r,r,r", [x], dtype=gl.int8, is_pure=True, pack=4)
    y = gl.reshape(y, [TB, 16, 4, 2, 4])  # tb, t', c, hh, i (byte 8 c + 4 hh + i)
    y = gl.permute(y, [1, 0, 3, 2, 4])  # t', tb, hh, c, i
    y = gl.reshape(y, [16, 32 * TB])
    return gl.convert_layout(y, A8_OP, assert_trivial=True)


@gluon.jit
def _rni(x):
    return gl.inline_asm_elementwise(_RNI_ASM, "=f,f", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _absmax(q):
    """Largest ``|q|`` of a B-layout tile: over k first (mostly a lane's own registers, then 2 shuffle rounds), then 3
    rounds over the columns (the other order shuffles each lane's 16 values of k: ~200 shuffles, ~4 us per program)."""
    return gl.max(gl.max(gl.abs(q), 0), 0)


@gluon.jit
def _q8_split(q, f):
    """``q f = hi + lo / 254`` with int8 ``hi`` (``|q f| <= 127``) and ``lo``: 15 bits of the group's largest entry,
    where fp16 operands keep 11 of each entry's own."""
    x = q * f
    hi = _rni(x)
    lo = _rni((x - hi) * 254.0)
    return hi.to(gl.int8), lo.to(gl.int8)


@gluon.jit
def _q_plane(q_ptr, sqm, M, P: gl.constexpr, TB: gl.constexpr, MH: gl.constexpr, K8: gl.constexpr,
             TP: gl.constexpr = 1):
    """``q[h, 32 P + sigma(j)]`` (float32) as the key MMA's B operand ``[32 TB, 8]``: row ``tb * 32 + j``, column
    ``tb * MH + h`` (0 off the block diagonal), ``sigma`` the order of :func:`_k_operand` (``K8``: :func:`_k8_operand`).
    ``TP = 2``: column ``e * MH + h`` only in rows of token ``2j + e`` (docs/kernels.md §3.3)."""
    OP: gl.constexpr = B8_OP if K8 else B_OP
    k = gl.arange(0, 32 * TB, layout=gl.SliceLayout(1, OP))
    n = gl.arange(0, 8, layout=gl.SliceLayout(0, OP))
    j = k % 32
    if K8:
        sig = 8 * ((j % 16) // 4) + 4 * (j // 16) + j % 4
    else:
        sig = 8 * ((j >> 1) & 3) + 4 * (j >> 4) + 2 * ((j >> 3) & 1) + (j & 1)
    h = n % MH
    if TP == 2:
        ok = ((sig // 16)[:, None] == (n // MH)[None, :]) & (h < M)[None, :]
        x = gl.load(q_ptr + h[None, :] * sqm + (16 * P + sig % 16)[:, None], mask=ok, other=0.0)
    else:
        ok = ((k // 32)[:, None] == (n // MH)[None, :]) & (h < M)[None, :] & (n < TB * MH)[None, :]
        x = gl.load(q_ptr + h[None, :] * sqm + (32 * P + sig)[:, None], mask=ok, other=0.0)
    return x


@gluon.jit
def _q_sums(q, qk_scale, GC: gl.constexpr = 2):
    """Per column (``SliceLayout(0, MMA)``): ``Qs_g``, the sum of group ``g``'s query channels times ``qk_scale``,
    from the 32-channel chunks of :func:`_q_plane` (a tuple; group ``g``: chunks ``GC g .. GC g + GC - 1``; zero off
    the column's token set; a sum over a permutation of the channels), so that the query is loaded once."""
    s = ()
    for g in gl.static_range(len(q) // GC):
        x = gl.sum(q[GC * g], 0)
        for j in gl.static_range(1, GC):
            x = x + gl.sum(q[GC * g + j], 0)
        s = s + (x,)
    r = ()
    for g in gl.static_range(len(q) // GC):
        r = r + (gl.convert_layout(s[g] * qk_scale, gl.SliceLayout(0, MMA)),)
    return r


@gluon.jit
def _q8_operands(q_ptr, sqm, M, qk_scale, TB: gl.constexpr, MH: gl.constexpr):
    """K8 query operands: per plane ``(hi, lo)`` int8 (``B8_OP``) of ``q_P = q qk_scale / 4^P`` over ``sigma_g`` (the
    group's largest ``|q_P|`` / 127); per group the accumulator starts (int32 ``[16, 8]``, plane 3's ``+128 sum q``) and
    the factor ``sigma_g / 254`` of ``254 acc_hi + acc_lo``; last, the groups' query sums (:func:`_q_sums`)."""
    q0 = _q_plane(q_ptr, sqm, M, 0, TB, MH, True)
    q1 = _q_plane(q_ptr, sqm, M, 1, TB, MH, True)
    q2 = _q_plane(q_ptr, sqm, M, 2, TB, MH, True)
    q3 = _q_plane(q_ptr, sqm, M, 3, TB, MH, True)
    sg0 = gl.maximum(gl.maximum(_absmax(q0), 0.25 * _absmax(q1)) * qk_scale, 1e-30) / 127.0
    sg1 = gl.maximum(gl.maximum(_absmax(q2), 0.25 * _absmax(q3)) * (qk_scale / 16.0), 1e-30) / 127.0
    h0, l0 = _q8_split(q0, qk_scale / sg0)
    h1, l1 = _q8_split(q1, qk_scale * 0.25 / sg0)
    h2, l2 = _q8_split(q2, qk_scale * 0.0625 / sg1)
    h3, l3 = _q8_split(q3, qk_scale * 0.015625 / sg1)
    # plane 3's codes enter as 64 code - 128: its group's accumulators start at 128 sum_k q (per column)
    hs = gl.convert_layout(gl.sum(h3.to(gl.int32), 0), gl.SliceLayout(0, MMA))
    ls = gl.convert_layout(gl.sum(l3.to(gl.int32), 0), gl.SliceLayout(0, MMA))
    z = gl.zeros([16, 8], gl.int32, layout=MMA)
    qs = _q_sums((q0, q1, q2, q3), qk_scale)
    return (((h0, l0), (h1, l1), (h2, l2), (h3, l3)), ((z, z, sg0 / 254.0),
            (z + 128 * hs[None, :], z + 128 * ls[None, :], sg1 / 254.0)), qs)


@gluon.jit
def _q8_tile(base, P: gl.constexpr, HL: gl.constexpr, TB: gl.constexpr):
    """Tile ``(P, HL)`` of the prologue's int8 query operands (``query_triton._rotate_plane_q8``: ``[4, 2, 8 n,
    32 TB k]``, k contiguous) in the B layout of ``m16n8k32``: a lane's 4 consecutive k are one 4-byte word."""
    k = gl.arange(0, 32 * TB, layout=gl.SliceLayout(1, B8_OP))
    n = gl.arange(0, 8, layout=gl.SliceLayout(0, B8_OP))
    return gl.load(base + ((P * 2 + HL) * 8 + n[None, :]) * (32 * TB) + k[:, None])


@gluon.jit
def _q8_loaded(QP8, QPF, pid_bh, TB: gl.constexpr):
    """:func:`_q8_operands`' results loaded from what the prologue built for this (row, KV head) (``QPRE``): the
    tiles, the accumulator starts (plane 3's ``128 sum``), ``sigma_g / 254`` and the query sums (``Qs_g``: the sum of
    its planes' sums)."""
    base = QP8 + pid_bh.to(gl.int64) * (2048 * TB)  # (query_triton.Q8_TILE_BYTES * TB)
    fp = QPF + pid_bh.to(gl.int64) * 64
    cn = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    qs0 = gl.load(fp + cn) + gl.load(fp + 8 + cn)  # (the planes' sums)
    qs1 = gl.load(fp + 16 + cn) + gl.load(fp + 24 + cn)
    hs = gl.load(fp + 32 + cn).to(gl.int32)
    ls = gl.load(fp + 40 + cn).to(gl.int32)
    f0 = gl.load(fp + 48) / 254.0
    f1 = gl.load(fp + 56) / 254.0
    z = gl.zeros([16, 8], gl.int32, layout=MMA)
    return (((_q8_tile(base, 0, 0, TB), _q8_tile(base, 0, 1, TB)), (_q8_tile(base, 1, 0, TB), _q8_tile(base, 1, 1, TB)),
             (_q8_tile(base, 2, 0, TB), _q8_tile(base, 2, 1, TB)),
             (_q8_tile(base, 3, 0, TB), _q8_tile(base, 3, 1, TB))),
            ((z, z, f0), (z + hs[None, :], z + ls[None, :], f1)), (qs0, qs1))


@gluon.jit
def _v_planes(x, BB: gl.constexpr):
    """Value codes of byte position ``BB`` of the word tile ``x [T, 8]`` (int32): four bf16 tiles (planes)."""
    return gl.inline_asm_elementwise(_V_ASM[BB], "=r,=r,=r,=r,r,r", [x],
                                     dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16), is_pure=True, pack=2)


@gluon.jit
def _v_operand(o0, o1, o2, o3, T: gl.constexpr):
    """One plane's tiles of byte positions 0..3 (``[T t, 8 w]``) -> the A operand ``[32 m, T t]`` of
    ``outᵀ = Vᵀ Wᵀ``, row ``m = 8 bb + w`` (channel ``4 w + bb`` of the plane: ``sigma_V``). Register renaming."""
    j = gl.join(gl.join(o0, o1), gl.join(o2, o3))  # [T, 8, 2, 2]: t, w, bb & 1, bb >> 1
    j = gl.permute(j, [3, 2, 1, 0])
    j = gl.reshape(j, [32, T])
    return gl.convert_layout(j, A_OP, assert_trivial=True)


@gluon.jit
def _w_operand(w, kdiag, TB: gl.constexpr):
    """``w [16 t', 8 n]`` (bf16, accumulator layout) -> the value MMA's B operand ``[16 TB k, 8 n]``:
    ``movmatrix.trans`` per 8x8 block, then a register renaming. TB = 2: row ``k = 16 tb + t'`` sees column ``n`` only
    in its token set (``kdiag``)."""
    y = gl.inline_asm_elementwise(_MOVM_ASM, "=r,r", [w], dtype=gl.bfloat16, is_pure=True, pack=2)
    y = gl.reshape(y, [2, 8, 8])
    y = gl.permute(y, [0, 2, 1])
    y = gl.reshape(y, [16, 8])
    if TB == 1:
        return gl.convert_layout(y, B_OP, assert_trivial=True)
    else:
        y = gl.join(y, y)  # [16, 8, TB]
        y = gl.permute(y, [2, 0, 1])
        y = gl.reshape(y, [16 * TB, 8])
        y = gl.convert_layout(y, B_OP, assert_trivial=True)
        # kdiag: int16 -1 / 0; one `and` per register (two bf16), not a select per element and a repack
        return gl.inline_asm_elementwise("and.b32 $0, $1, $2;", "=r,r,r", [y, kdiag], dtype=gl.bfloat16,
                                         is_pure=True, pack=2)


@gluon.jit
def _rc(x):
    """A per-lane value ``[32]`` (lane ``4r + c``) as ``[8 r, 4 c]``."""
    return gl.reshape(x, [8, 4])


@gluon.jit
def _lane_asm(KIND: gl.constexpr, TB: gl.constexpr, NH: gl.constexpr, ptr, lo, hi, MASKED: gl.constexpr):
    """Loads from one address per lane (``KIND`` 0: key rows, 1: value tokens, 2: metadata words), rows of ``NH``
    32-byte halves (metadata: ``NH`` words a token)."""
    if KIND == 0:
        asm: gl.constexpr = _KLD_ASM[4 * NH - 4 + 2 * TB - 2 + MASKED]
        n: gl.constexpr = 4 * TB
    elif KIND == 1:
        asm: gl.constexpr = _VLD_ASM[4 * NH - 4 + 2 * TB - 2 + MASKED]
        n: gl.constexpr = 4 * TB
    else:
        asm: gl.constexpr = _MLD_ASM[2 * NH - 2 + MASKED]
        n: gl.constexpr = 2
    if MASKED:
        return gl.inline_asm_elementwise(asm, "=r," * n + "l,r,r", [ptr, lo, hi], dtype=(gl.int32,) * n,
                                         is_pure=False, pack=1)
    else:
        return gl.inline_asm_elementwise(asm, "=r," * n + "l", [ptr], dtype=(gl.int32,) * n, is_pure=False, pack=1)


@gluon.jit
def _lane_tile(x, TB: gl.constexpr, PERM2: gl.constexpr, PERM1: gl.constexpr, LAYOUT: gl.constexpr):
    """The ``4 TB`` per-lane registers of :func:`_lane_asm` (``[32]`` each: ``r, c`` by lane, register ``j + 2 i``) as
    the ``[16 TB, 8]`` word tile in ``LAYOUT`` (a renaming of registers; ``PERM*`` order ``r, c, j, i0 (, i1)``)."""
    if TB == 2:
        y = gl.join(gl.join(gl.join(_rc(x[0]), _rc(x[1])), gl.join(_rc(x[2]), _rc(x[3]))),
                    gl.join(gl.join(_rc(x[4]), _rc(x[5])), gl.join(_rc(x[6]), _rc(x[7]))))  # r, c, j, i0, i1
        y = gl.permute(y, PERM2)
    else:
        y = gl.join(gl.join(_rc(x[0]), _rc(x[1])), gl.join(_rc(x[2]), _rc(x[3])))  # r, c, j, i0
        y = gl.permute(y, PERM1)
    return gl.convert_layout(gl.reshape(y, [16 * TB, 8]), LAYOUT, assert_trivial=True)


@gluon.jit
def _meta_tile(w):
    """Metadata words of logit rows ``r``, ``r + 8`` (two ``[32]``) as the logit tile ``[16, 8]`` (both columns of a
    lane: the same token)."""
    x = gl.join(_rc(w[0]), _rc(w[1]))  # r, c, a
    x = gl.permute(gl.join(x, x), [2, 0, 1, 3])  # a, r, c, j
    return gl.convert_layout(gl.reshape(x, [16, 8]), MMA, assert_trivial=True)


@gluon.jit
def _meta_tiles(ptr, lo, hi, TB: gl.constexpr, NH: gl.constexpr, MASKED: gl.constexpr):
    """A tensor's ``NH`` metadata words of the step's tokens (per-lane address ``ptr`` at its first token, ``NH`` words
    a token) as a tuple of logit tiles."""
    t = ()
    for w in gl.static_range(NH):
        t = t + (_meta_tile(_lane_asm(2, TB, NH, ptr + w, lo, hi, MASKED)),)
    return t


settle_cache_keys(globals())  # (plan.settle_cache_keys: the same kernel keys in every process)
