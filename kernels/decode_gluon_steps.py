"""The Gluon history kernel's steps (after :mod:`.decode_gluon_ops`): loads, addresses, copies, logits, setup."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from .decode_gluon_ops import (_cp_async, CP_CODES, CP_META, _k8_operand, _K_ASM, _k_operand, _k_plane, KLOAD,
                               _lane_asm, _lane_tile, LANES, META3, _meta_tiles, MMA, SMEM3, _v_operand, _v_planes,
                               VLOAD, _w_operand)
from .plan import settle_cache_keys


@gluon.jit
def _pair_valid(n0, start, hi):
    """TP = 2 (code rows of two tokens; ``n0`` a row): whether each logit of the step is a token in ``[start, hi)``:
    row ``t'``, column ``4 e + h`` is token ``2 (n0 + t') + e``."""
    tr = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    tn = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    tok = 2 * (n0 + tr)[:, None] + (tn // 4)[None, :]
    return (tok < hi) & (tok >= start)


@gluon.jit
def _loads_lanes(kl, vl, ksl, kzl, vsl, vzl, n0, co, mo, lo, hi, lr, lc, mr, TB: gl.constexpr, NH: gl.constexpr,
                 MASKED: gl.constexpr, TP: gl.constexpr = 1):
    """The step at ``n0``'s tiles from per-lane addresses at token 0 (lane ``4r + c``: key row ``r``, value token
    ``2c``, metadata of logit row ``r``): ``NH`` key and value word tiles, ``NH`` metadata tiles per tensor. ``MASKED``:
    tokens outside ``[lo, hi)`` read as 0 (``TP = 2``: per token of a row, metadata zeroed by :func:`_pair_valid`)."""
    big = -(1 << 30)
    if TP == 2:  # the token bounds as row bounds: keys (lane column c: token 2 row + c // 2), values (word r: token
        # 2 row + r // 4), metadata words (either token)
        hik = (hi - lc // 2 + 1) >> 1
        hiv = (hi - lr // 4 + 1) >> 1
        him = (hi + 1) >> 1
        lom = lo >> 1
    else:
        hik = hi
        hiv = hi
        him = hi
        lom = lo
    k = ()
    v = ()
    for hh in gl.static_range(NH):
        k = k + (_lane_asm(0, TB, NH, kl + (co + 8 * hh), big - lr, hik - n0 - lr, MASKED),)
        v = v + (_lane_asm(1, TB, NH, vl + (co + 8 * hh), big - lr, hiv - n0 - 2 * lc, MASKED),)
    ks = _meta_tiles(ksl + mo, big - mr, him - n0 - mr, TB, NH, MASKED)
    kz = _meta_tiles(kzl + mo, big - mr, him - n0 - mr, TB, NH, MASKED)
    vs = _meta_tiles(vsl + mo, lom - n0 - mr, him - n0 - mr, TB, NH, MASKED)
    vz = _meta_tiles(vzl + mo, lom - n0 - mr, him - n0 - mr, TB, NH, MASKED)
    if TP == 2 and MASKED:  # (a word's other token may be padding whose storage holds NaN: W = p s must stay 0)
        ok = _pair_valid(n0, lo, hi)
        vs = (gl.where(ok, vs[0], 0),)
        vz = (gl.where(ok, vz[0], 0),)
    xk = ()
    xv = ()
    for hh in gl.static_range(NH):
        xk = xk + (_lane_tile(k[hh], TB, [4, 3, 0, 1, 2], [3, 0, 1, 2], KLOAD),)  # i1, i0, r, c, j
        xv = xv + (_lane_tile(v[hh], TB, [4, 3, 1, 2, 0], [3, 1, 2, 0], VLOAD),)  # i1, i0, c, j, r
    return xk, xv, ks, kz, vs, vz


@gluon.jit
def _page_of(bt_row, n0, PR: gl.constexpr):
    """The page id of code row ``n0`` (a paged history: ``PR`` code rows a page, ``bt_row`` the row's block table;
    an entry past the row's pages, -1, reads as page 0: only masked loads use it)."""
    return gl.maximum(gl.load(bt_row + n0 // PR), 0)


@gluon.jit
def _page_offs(pg, n0, cps, mps, NH: gl.constexpr, PR: gl.constexpr):
    """Word offsets (codes, metadata) of code row ``n0`` in page ``pg`` (``cps``, ``mps``: page strides in words)."""
    r, pw = n0 % PR, pg.to(gl.int64)
    return pw * cps + r * (8 * NH), pw * mps + r * NH


@gluon.jit
def _row_offs(n0, bt_row, cps, mps, NH: gl.constexpr, PAGED: gl.constexpr, PR: gl.constexpr):
    """Word offsets (codes, metadata) of code row ``n0`` from the (row, head)'s bases: ``n0`` rows of ``8 NH`` and
    ``NH`` words in a contiguous history; ``PAGED``: row ``n0 % PR`` of page ``bt_row[n0 // PR]``."""
    if PAGED:
        return _page_offs(_page_of(bt_row, n0, PR), n0, cps, mps, NH, PR)
    else:
        return n0 * (8 * NH), n0 * NH


@gluon.jit
def _issue_copies(kbuf, vbuf, mbuf, stage, ck, cv, cm, co, mo):
    """cp.async of the full step at word offsets ``co`` (codes), ``mo`` (metadata) into ``stage``: one commit group."""
    _cp_async(kbuf.index(stage), ck + co)
    _cp_async(vbuf.index(stage), cv + co)
    _cp_async(mbuf.index(stage), cm + mo)
    async_copy.commit_group()


@gluon.jit
def _issue_first_copies(kbuf, vbuf, mbuf, ck, cv, cm, f0, f1, T: gl.constexpr, STAGES: gl.constexpr,
                        NH: gl.constexpr, bt_row, cps, mps, PAGED: gl.constexpr, PR: gl.constexpr):
    """The pipeline's start: the copies of the first ``STAGES - 1`` full steps of ``[f0, f1)`` into stages
    ``0 .. STAGES - 2`` (none without full steps; past the last full step the copies repeat it, as in the loop)."""
    if f1 > f0:
        for i in gl.static_range(STAGES - 1):
            co, mo = _row_offs(gl.minimum(f0 + i * T, f1 - T), bt_row, cps, mps, NH, PAGED, PR)
            _issue_copies(kbuf, vbuf, mbuf, i, ck, cv, cm, co, mo)


@gluon.jit
def _smem_codes(buf, LAYOUT: gl.constexpr, NH: gl.constexpr):
    """A stage's code words ``[T, 8 NH]`` as the tuple of its ``NH`` halves' ``[T, 8]`` tiles in ``LAYOUT``."""
    if NH == 1:
        return (buf.load(LAYOUT),)
    else:
        t = ()
        for hh in gl.static_range(NH):
            t = t + (buf.slice(8 * hh, 8, dim=1).load(LAYOUT),)
        return t


@gluon.jit
def _smem_meta(mb, j: gl.constexpr, TB: gl.constexpr, NH: gl.constexpr):
    """Metadata tensor ``j`` (0..3: key scale, key zero, value scale, value zero) of a stage as the tuple of logit
    tiles of its ``NH`` words a token (NH = 2: TB = 1)."""
    if NH == 2:  # (mb: [4 x 16 t, 2 words]) [16 t', 2 words]
        x = mb.slice(16 * j, 16, dim=0)
        return (x.slice(0, 1, dim=1).load(MMA) + gl.zeros([16, 8], gl.int32, layout=MMA),
                x.slice(1, 1, dim=1).load(MMA) + gl.zeros([16, 8], gl.int32, layout=MMA))
    elif TB == 2:
        x = mb.slice(j * TB, TB, dim=0).permute([1, 0])  # [16 t', TB sets]
        y = x.load(gl.SliceLayout(2, META3))
        y = gl.expand_dims(y, 2) + gl.zeros([16, 2, 4], gl.int32, layout=META3)  # (a broadcast: + 0 folds)
        return (gl.convert_layout(gl.reshape(y, [16, 8]), MMA, assert_trivial=True),)
    else:
        y = mb.slice(j * TB, TB, dim=0).permute([1, 0]).load(MMA)  # [16 t', 1]
        return (y + gl.zeros([16, 8], gl.int32, layout=MMA),)


@gluon.jit
def _f32_pair(wd):
    """Both groups' bf16 scale (or zero) of a token, one int32 word, as float32 (group 0 in the low half)."""
    return (wd << 16).to(gl.float32, bitcast=True), (wd & -65536).to(gl.float32, bitcast=True)


@gluon.jit
def _f32_groups(words, TP: gl.constexpr = 1):
    """A token's ``NH`` metadata words (a tuple of tiles) as the tuple of its ``2 NH`` groups' float32 tiles. ``TP =
    2`` (D = 64: one group, a word holds the bf16 of tokens ``2j`` (low half) and ``2j + 1``): one tile, each logit
    column taking its token's half (columns ``4 e + h``: token ``2j + e``)."""
    g = ()
    if TP == 2:
        n = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
        sh = gl.where(n < 4, 16, 0)
        g = (((words[0] << sh[None, :]) & -65536).to(gl.float32, bitcast=True),)
    else:
        for w in gl.static_range(len(words)):
            g = g + _f32_pair(words[w])
    return g


@gluon.constexpr_function
def _groups(NH, TP):
    """Metadata groups the kernel keeps apart: two per 4-byte word (D = 128 NH: ``2 NH``, group ``g`` the chunks
    ``2g, 2g + 1``), or at D = 64 (``TP = 2``) one, all 4 chunks (the word's halves are two tokens, not groups)."""
    return 1 if TP == 2 else 2 * NH


@gluon.jit
def _k_chunk(u, i: gl.constexpr, TB: gl.constexpr, NH: gl.constexpr):
    """The key A operand of 32-channel chunk ``i`` (plane ``i // NH`` of half ``i % NH``) from the halves' codes."""
    P: gl.constexpr = i // NH
    x = u[i % NH]
    return _k_operand(_k_plane(x[4 * P], x[4 * P + 1], x[4 * P + 2], x[4 * P + 3]), TB)


@gluon.jit
def _logits(xk, ks, kz, n0, hi, start, qb, c, qs, offc,
            TB: gl.constexpr, MH: gl.constexpr, NH: gl.constexpr, MASKED: gl.constexpr, K8: gl.constexpr,
            TP: gl.constexpr = 1):
    """Logits ``[16, 8]`` (log2 units, ``offc = off - phi``) of a step from its key word tiles ``xk`` and key metadata
    words, invalid tokens -inf when ``MASKED``. ``qb`` / ``c`` / ``qs``: the query operands of the ``4 NH`` chunks, the
    accumulator starts and the query sums of the groups (:func:`_groups`; ``K8``: :func:`_q8_operands`' pairs)."""
    s = _f32_groups(ks, TP)
    z = _f32_groups(kz, TP)
    if K8:
        k0 = _k8_operand(xk[0], 0, TB)
        k1 = _k8_operand(xk[0], 1, TB)
        k2 = _k8_operand(xk[0], 2, TB)
        k3 = _k8_operand(xk[0], 3, TB)
        y0 = mma_v2(k1, qb[1][0], mma_v2(k0, qb[0][0], c[0][0])) * 254 + \
            mma_v2(k1, qb[1][1], mma_v2(k0, qb[0][1], c[0][1]))
        y1 = mma_v2(k3, qb[3][0], mma_v2(k2, qb[2][0], c[1][0])) * 254 + \
            mma_v2(k3, qb[3][1], mma_v2(k2, qb[2][1], c[1][1]))
        # (bias after the MMAs in each branch: computed before them, ptxas spills 16 more bytes in the fp16 path)
        bias = gl.fma(z[0], qs[0][None, :], gl.fma(z[1], qs[1][None, :], offc[None, :]))
        lg = gl.fma(s[0] * c[0][2], y0.to(gl.float32), gl.fma(s[1] * c[1][2], y1.to(gl.float32), bias))
    else:
        # per half: the fp16 codes of its 4 planes (byte B of plane P in u[4P + B])
        u = ()
        for hh in gl.static_range(NH):
            u = u + (gl.inline_asm_elementwise(_K_ASM, "=h," * 16 + "r", [xk[hh]], dtype=(gl.float16,) * 16,
                                               is_pure=True, pack=1),)
        # one accumulator per group, of independent MMA chains (its chunks GC g .. GC g + GC - 1)
        NG: gl.constexpr = _groups(NH, TP)
        GC: gl.constexpr = 4 * NH // NG
        zk = gl.zeros_like(c[0])
        a = ()
        for g in gl.static_range(NG):
            x = mma_v2(_k_chunk(u, GC * g, TB, NH), qb[GC * g], c[g])
            for j in gl.static_range(1, GC):
                x = x + mma_v2(_k_chunk(u, GC * g + j, TB, NH), qb[GC * g + j], zk)
            a = a + (x,)
        bias = offc[None, :]
        for g in gl.static_range(NG - 1, -1, -1):
            bias = gl.fma(z[g], qs[g][None, :], bias)
        lg = bias
        for g in gl.static_range(NG - 1, -1, -1):
            lg = gl.fma(s[g], a[g], lg)
    if MASKED and TP == 2:
        lg = gl.where(_pair_valid(n0, start, hi), lg, float("-inf"))
    elif MASKED:
        tr = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
        tn = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
        tok = n0 + tr[:, None] + 16 * (tn // MH)[None, :]
        lg = gl.where((tok < hi) & (tok >= start), lg, float("-inf"))
    return lg


@gluon.constexpr_function
def _col_sets(TB, TP):
    """The logit tile's column sets: ``TB`` token sets, or at D = 64 (``TP = 2``) the two tokens of a code row."""
    return 2 if TP == 2 else TB


@gluon.jit
def _fresh_state(NH: gl.constexpr, TP: gl.constexpr = 1):
    """The split's running tiles at the start of a pass: ``l``, ``max`` (``[16, 8]``), ``sum p z`` per group (``NG =
    _groups(NH, TP)`` tiles ``[16, 8]``), the ``4 NH`` chunk accumulators (``[32, 8]``) and the group sums of ``W``
    (``NG`` tiles ``[16, 8]``, every row the column sums)."""
    NG: gl.constexpr = _groups(NH, TP)
    z16 = gl.zeros([16, 8], gl.float32, layout=MMA)
    z32 = gl.zeros([32, 8], gl.float32, layout=MMA)
    return (z16, gl.full([16, 8], float("-inf"), gl.float32, layout=MMA), (z16,) * NG, (z32,) * (4 * NH),
            (z16,) * NG)


@gluon.jit
def _accumulate(lg, xv, vs, vz, kdiag, ones, state, TB: gl.constexpr, NH: gl.constexpr, TP: gl.constexpr = 1):
    """A step's logits ``lg [16, 8]`` (minus the reference) into the running state (:func:`_fresh_state`): the deferred
    softmax tiles, the value MMAs of the ``4 NH`` chunks and, against the tile ``ones``, each group's ``sum W`` (the
    value codes' offset, subtracted once after the loop; docs/kernels.md §3.3)."""
    T: gl.constexpr = 16 * TB
    NG: gl.constexpr = _groups(NH, TP)
    GC: gl.constexpr = 4 * NH // NG
    lt, mt, zt, acc, sw = state
    vsg = _f32_groups(vs, TP)
    vzg = _f32_groups(vz, TP)
    mt = gl.maximum(mt, lg)
    p = gl.exp2(lg)
    lt += p
    zt_ = ()
    for g in gl.static_range(NG):
        zt_ = zt_ + (gl.fma(p, vzg[g], zt[g]),)
    w = ()
    for g in gl.static_range(NG):
        w = w + (_w_operand((p * vsg[g]).to(gl.bfloat16), kdiag, TB),)
    acc_ = ()
    for hh in gl.static_range(NH):
        a0 = _v_planes(xv[hh], 0)  # byte position BB: the tiles of planes 0..3
        a1 = _v_planes(xv[hh], 1)
        a2 = _v_planes(xv[hh], 2)
        a3 = _v_planes(xv[hh], 3)
        for P in gl.static_range(4):  # chunk P NH + hh, group (P NH + hh) // GC
            acc_ = acc_ + (mma_v2(_v_operand(a0[P], a1[P], a2[P], a3[P], T), w[(P * NH + hh) // GC],
                                  acc[P * NH + hh]),)
    if NH == 2:  # (back to chunk order: acc_ holds half 0's planes, then half 1's)
        acc_ = (acc_[0], acc_[4], acc_[1], acc_[5], acc_[2], acc_[6], acc_[3], acc_[7])
    sw_ = ()
    for g in gl.static_range(NG):  # 2 TB MMAs a step per group for the offsets, not one after each value MMA
        sw_ = sw_ + (mma_v2(ones, w[g], sw[g]),)
    return lt, mt, zt_, acc_, sw_


@gluon.jit
def _step(xk, xv, ks, kz, vs, vz, n0, hi, start, qb, c, qs, offc, kdiag, ones, state,
          TB: gl.constexpr, MH: gl.constexpr, NH: gl.constexpr, MASKED: gl.constexpr, K8: gl.constexpr,
          TP: gl.constexpr = 1):
    """One step of ``16 TB`` code rows (``TP`` tokens each) from its loaded words: logits, then :func:`_accumulate`."""
    lg = _logits(xk, ks, kz, n0, hi, start, qb, c, qs, offc, TB, MH, NH, MASKED, K8, TP)
    return _accumulate(lg, xv, vs, vz, kdiag, ones, state, TB, NH, TP)


@gluon.jit
def _q_operand(q, qk_scale, P: gl.constexpr):
    """fp16 B operand of plane ``P`` from its :func:`_q_plane` ``q``: times ``qk_scale / 4^P``."""
    return (q * (qk_scale * (0.25 ** P))).to(gl.float16)


@gluon.jit
def _split_setup(KC, KS, KZ, VC, VS, VZ, START, NPTR, b, h, pid_s, N, S, split_len,
                 skb, skh, smkb, smkh, svb, svh, smvb, smvh, T: gl.constexpr, TB: gl.constexpr, NH: gl.constexpr,
                 N_DEV: gl.constexpr, TP: gl.constexpr = 1, PAGED: gl.constexpr = 0):
    """The split's ``start``, ``[lo, hi)`` (all-padding steps skipped; ``PAGED``: ``hi`` from ``NPTR[b]``), full steps
    ``[f0, f1)`` after the reference step, :func:`_loads_lanes`' lane addresses and the six int32 base pointers.
    ``TP = 2``: ``lo``, ``f0``, ``f1`` count rows (full: both tokens ``< hi``)."""
    start = gl.load(START + b).to(gl.int32)
    if N_DEV:
        n_tot = gl.minimum(gl.load(NPTR).to(gl.int32), N)
        if TP == 2:  # (split lengths in code rows)
            n_rows = (n_tot + 1) >> 1
        else:
            n_rows = n_tot
        slen = gl.cdiv(gl.cdiv(gl.maximum(n_rows, 1), S), T) * T
    else:
        n_tot = N
        if PAGED:
            n_tot = gl.minimum(gl.load(NPTR + b).to(gl.int32), N)
        if TP == 2:
            slen = split_len >> 1
        else:
            slen = split_len
    if TP == 2:  # the first row that holds a token >= start; the split's end as a token
        start_row = start >> 1
        end = 2 * (pid_s * slen + slen)
    else:
        start_row = start
        end = pid_s * slen + slen
    hi = gl.minimum(end, n_tot)
    lo = gl.maximum(pid_s * slen, (start_row // T) * T)  # skip all-padding blocks
    f0 = lo + T
    if TP == 2:  # full rows only: both tokens < hi
        hi_full = hi >> 1
    else:
        hi_full = hi
    f1 = f0 + gl.maximum(hi_full - f0, 0) // T * T
    kc_base = (KC + b.to(gl.int64) * skb + h * skh).to(gl.pointer_type(gl.int32))
    vc_base = (VC + b.to(gl.int64) * svb + h * svh).to(gl.pointer_type(gl.int32))
    ks_base = (KS + b.to(gl.int64) * smkb + h * smkh).to(gl.pointer_type(gl.int32))
    kz_base = (KZ + b.to(gl.int64) * smkb + h * smkh).to(gl.pointer_type(gl.int32))
    vs_base = (VS + b.to(gl.int64) * smvb + h * smvh).to(gl.pointer_type(gl.int32))
    vz_base = (VZ + b.to(gl.int64) * smvb + h * smvh).to(gl.pointer_type(gl.int32))
    # per-lane addresses at token 0 (_loads_lanes)
    ln = gl.arange(0, 32, layout=LANES)
    lr = ln // 4
    lc = ln % 4
    kl = kc_base + (lr * (8 * NH) + 2 * lc)
    vl = vc_base + (2 * lc * (8 * NH) + lr)
    mr = lr
    if TB == 2:  # columns 4..7 (lanes with c >= 2) are the second token set
        mr = lr + 16 * (lc // 2)
    mw = mr * NH  # (the token's first metadata word)
    return (start, hi, lo, f0, f1, kl, vl, ks_base + mw, kz_base + mw, vs_base + mw, vz_base + mw, lr, lc, mr,
            kc_base, vc_base, ks_base, kz_base, vs_base, vz_base)


@gluon.jit
def _copy_setup(kc_base, vc_base, ks_base, kz_base, vs_base, vz_base, T: gl.constexpr, TB: gl.constexpr,
                NH: gl.constexpr, STAGES: gl.constexpr):
    """The cp.async pipeline's shared buffers (``STAGES`` stages) and its per-lane source addresses at token 0:
    code words ``[T, 8 NH]`` of keys and values, metadata words ``[4 TB, 16]`` (NH = 2, TB = 1: ``[4 x 16 t, 2]``,
    a token's two words a row; see ``CP_META``)."""
    kbuf = gl.allocate_shared_memory(gl.int32, [STAGES, T, 8 * NH], SMEM3)
    vbuf = gl.allocate_shared_memory(gl.int32, [STAGES, T, 8 * NH], SMEM3)
    cr = gl.arange(0, T, layout=gl.SliceLayout(1, CP_CODES))
    cw = gl.arange(0, 8 * NH, layout=gl.SliceLayout(0, CP_CODES))
    ck = kc_base + (cr[:, None] * (8 * NH) + cw[None, :])
    cv = vc_base + (cr[:, None] * (8 * NH) + cw[None, :])
    CPM: gl.constexpr = CP_META[TB - 1 + 2 * (NH - 1)]
    if NH == 1:
        mbuf = gl.allocate_shared_memory(gl.int32, [STAGES, 4 * TB, 16], SMEM3)
        mrow = gl.arange(0, 4 * TB, layout=gl.SliceLayout(1, CPM))[:, None]
        mj = mrow // TB
        mt_ = (mrow % TB) * 16 + gl.arange(0, 16, layout=gl.SliceLayout(0, CPM))[None, :]
    else:
        mbuf = gl.allocate_shared_memory(gl.int32, [STAGES, 64, NH], SMEM3)
        mrow = gl.arange(0, 64, layout=gl.SliceLayout(1, CPM))[:, None]
        mj = mrow // 16
        mt_ = (mrow % 16) * NH + gl.arange(0, NH, layout=gl.SliceLayout(0, CPM))[None, :]
    cm = gl.where(mj == 0, ks_base + mt_, gl.where(mj == 1, kz_base + mt_, gl.where(mj == 2, vs_base + mt_,
                                                                                   vz_base + mt_)))
    return kbuf, vbuf, mbuf, ck, cv, cm


settle_cache_keys(globals())  # (plan.settle_cache_keys: the same kernel keys in every process)
