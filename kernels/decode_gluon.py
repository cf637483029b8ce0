"""The decode read's history programs in Gluon (Triton's explicit-layout dialect): ``decode_split._split_kernel``'s
contract (partials in the rotated value space) for the shapes :func:`gluon_supported` takes, one warp a program on
mma.sync ``m16n8k16``; GPU only. Design, operand layouts, ``K8`` / ``QPRE`` / ``NH`` / ``TP``: docs/kernels.md §3.3.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from .decode_gluon_ops import (A_OP, B_OP, DF_LIM, KLOAD, MMA, _q8_loaded, _q8_operands, _q_plane, _q_sums, _SPIN_ASM,
                               _sync, VLOAD)
from .decode_gluon_steps import (_accumulate, _col_sets, _copy_setup, _fresh_state, _groups, _issue_copies,
                                 _issue_first_copies, _loads_lanes, _logits, _page_of, _page_offs, _q_operand,
                                 _row_offs, _smem_codes, _smem_meta, _split_setup, _step)
from .plan import cuda_major, gluon_query_groups, settle_cache_keys, tokens_per_step


@gluon.jit(do_not_specialize=["N", "M", "S", "S_TOT", "split_len", "sbt"])  # (as decode_split._split_kernel)
def _hist_kernel(
    Q, KC, KS, KZ, VC, VS, VZ, START, QKOFF, NPTR,
    PM, PL, PACC,
    N, M, Hk, S, S_TOT, split_len, qk_scale,
    sqb, sqh, sqm, skb, skh, smkb, smkh, svb, svh, smvb, smvh, sob, soh, som,
    TB: gl.constexpr, HAS_OFF: gl.constexpr, N_DEV: gl.constexpr,
    STAGES: gl.constexpr = 2, PDL: gl.constexpr = 0, K8: gl.constexpr = 0, NH: gl.constexpr = 1,
    QP8=None, QPF=None, QPRE: gl.constexpr = 0, READY=None, QFLAG: gl.constexpr = 0, TP: gl.constexpr = 1,
    BT=None, sbt=0, cps=0, mps=0, PAGED: gl.constexpr = 0, PR: gl.constexpr = 1, QG: gl.constexpr = 1,
):
    """Program ``(q, s)``: the partial of history split ``s`` for query rows ``[g M, (g + 1) M)``, ``g = q % QG``, of
    (row, KV head) ``q // QG``. Flags: docs/kernels.md §3.3, §3.6, §3.8. ``PAGED``: code row ``j`` is row ``j % PR`` of
    page ``BT[b, j // PR]`` (``cps`` / ``mps``: page strides in 4-byte words), ``NPTR[b]`` the row's tokens."""
    CS: gl.constexpr = _col_sets(TB, TP)  # column sets: the token sets, or (TP = 2) the two tokens of a code row
    MH: gl.constexpr = 8 // CS
    T: gl.constexpr = 16 * TB  # code rows a step
    NG: gl.constexpr = _groups(NH, TP)  # metadata groups, each of GC chunks
    GC: gl.constexpr = 4 * NH // NG
    pid_bh = gl.program_id(0) // QG  # (row, KV head)
    grp = gl.program_id(0) % QG  # its query group
    pid_s = gl.program_id(1)
    b = pid_bh // Hk
    h = pid_bh % Hk
    part = (pid_bh.to(gl.int64) * S_TOT + pid_s) * (M * QG) + grp * M
    wdep = pid_s
    bt_row = BT
    if PAGED:
        bt_row = BT + b.to(gl.int64) * sbt
    # the split's first loads before anything that needs the query: the reference step's words into registers and
    # the first full steps' copies, so that their memory latency overlaps the query's loads (PDL: and the launch
    # before this one, which computes the query)
    (start, hi, lo, f0, f1, kl, vl, ksl, kzl, vsl, vzl, lr, lc, mr, kc_base, vc_base, ks_base, kz_base, vs_base,
     vz_base) = _split_setup(KC, KS, KZ, VC, VS, VZ, START, NPTR, b, h, pid_s, N, S, split_len,
                             skb, skh, smkb, smkh, svb, svh, smvb, smvh, T, TB, NH, N_DEV, TP, PAGED)
    if TP == 2:  # (hi counts tokens, the steps rows)
        hr = (hi + 1) >> 1
    else:
        hr = hi
    co, mo = _row_offs(lo, bt_row, cps, mps, NH, PAGED, PR)
    xk, xv, ks, kz, vs, vz = _loads_lanes(kl, vl, ksl, kzl, vsl, vzl, lo, co, mo, start, hi, lr, lc, mr, TB, NH, True,
                                          TP)
    kbuf, vbuf, mbuf, ck, cv, cm = _copy_setup(kc_base, vc_base, ks_base, kz_base, vs_base, vz_base, T, TB, NH,
                                               STAGES)
    _issue_first_copies(kbuf, vbuf, mbuf, ck, cv, cm, f0, f1, T, STAGES, NH, bt_row, cps, mps, PAGED, PR)
    if QFLAG:
        # instead of the PDL wait for the whole prologue grid: its rotation programs of this (row, head) count
        # themselves done in READY once their operands are stored (4 planes); the wait ends when this head's are,
        # not when the last prologue program has exited and the grid's completion reached us
        wdep = gl.inline_asm_elementwise(_SPIN_ASM, "=r,l,r", [READY + pid_bh, 4], dtype=gl.int32,
                                         is_pure=False, pack=1)
    elif PDL:
        wdep = gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                                         pack=1)
    # ---- query operands (once per program) ----
    q_ptr = Q + b.to(gl.int64) * sqb + h * sqh + grp * M * sqm
    cn = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    ch = cn % MH
    cvalid = (ch < M) & (cn < CS * MH)
    qz = 0
    if QFLAG:  # (the wait's 0 in the addresses of what the prologue wrote: these loads cannot move above it)
        qz = wdep
    if HAS_OFF:  # the logit offset q.mu_K per column
        off = gl.load(QKOFF + qz + b.to(gl.int64) * sob + h * soh + (grp * M + ch) * som, mask=cvalid,
                      other=0.0) * qk_scale
    else:
        off = gl.zeros([8], gl.float32, layout=gl.SliceLayout(0, MMA))
    # per column: Qs_g = sum of the group's (scaled) query channels, from the chunks (a load of its own was issued by
    # the compiler after the operands' arithmetic: a second round trip)
    if K8:
        if QPRE:  # built by the prologue, once per row and KV head
            qb, c, qs = _q8_loaded(QP8, QPF, pid_bh + qz, TB)
        else:
            qb, c, qs = _q8_operands(q_ptr, sqm, M, qk_scale, TB, MH)
    else:
        # the 4 NH 32-channel chunks (chunk i: plane i // NH of half i % NH; group i // GC)
        qp = ()
        for i in gl.static_range(4 * NH):
            qp = qp + (_q_plane(q_ptr, sqm, M, i, TB, MH, False, TP),)
        qs = _q_sums(qp, qk_scale, GC)
        qb = ()
        for i in gl.static_range(4 * NH):
            qb = qb + (_q_operand(qp[i], qk_scale, i // NH),)
        # accumulator start -1024 C_g (the code offset of the chunks of group g, from the rounded operands)
        cg = ()
        for g in gl.static_range(NG):
            x = gl.sum(qb[GC * g].to(gl.float32), 0)
            for j in gl.static_range(1, GC):
                x = x + gl.sum(qb[GC * g + j].to(gl.float32), 0)
            cg = cg + (x,)
        zero_t = gl.zeros([16, 8], gl.float32, layout=MMA)
        c = ()
        for g in gl.static_range(NG):
            c = c + (zero_t - 1024.0 * gl.convert_layout(cg[g], gl.SliceLayout(0, MMA))[None, :],)
    # B-operand mask of the block-diagonal value MMA (TB = 2) and the constant A tile of ones (the codes' offset)
    kk = gl.arange(0, 16 * TB, layout=gl.SliceLayout(1, B_OP))
    kn = gl.arange(0, 8, layout=gl.SliceLayout(0, B_OP))
    kdiag = gl.where((kk // 16)[:, None] == (kn // MH)[None, :], -1, 0).to(gl.int16)
    ones = gl.full([16, T], 1.0, gl.bfloat16, layout=A_OP)
    # reference phi per column: the max of the first step's valid logits (0 where there is none)
    lg = _logits(xk, ks, kz, lo, hi, start, qb, c, qs, off, TB, MH, NH, True, K8, TP)
    phi = gl.max(lg, 0)
    phi = gl.where(phi == float("-inf"), 0.0, phi)
    phi = gl.where(cvalid, phi, 0.0)
    m_c = gl.full([8], float("-inf"), gl.float32, layout=gl.SliceLayout(0, MMA))
    # the first step (which may hold padding) is the reference step, its logits known; then the full steps [f0, f1)
    # in a loop without masks, and a last step [f1, hi) if any (full steps: all tokens >= start, since lo + T > start).
    # state: l, max, sum p z per group, the chunk accumulators, sum W per group (_fresh_state)
    state = _accumulate(lg - phi[None, :], xv, vs, vz, kdiag, ones, _fresh_state(NH, TP), TB, NH, TP)
    run = 1
    while run > 0:
        offc = off - phi
        # full steps through shared memory: the copies of step i + STAGES - 1 are issued before step i is read (its
        # stage was read in step i - 1: the barrier orders the two); wait_group leaves STAGES - 2 newer groups in
        # flight, the barrier makes every lane's copies of step i visible to the others (past the last full step the
        # copies repeat it -- f1 - T -- so that every step issues the same). The first pass's first copies were
        # issued before the query's loads (a rerun, run == 2, issues them)
        if run == 2:
            _issue_first_copies(kbuf, vbuf, mbuf, ck, cv, cm, f0, f1, T, STAGES, NH, bt_row, cps, mps, PAGED, PR)
        if PAGED:  # the page of the loop's first copies (then each iteration loads the next one's)
            pgn = _page_of(bt_row, gl.minimum(f0 + (STAGES - 1) * T, f1 - T), PR)
        for it in range(0, (f1 - f0) // T):
            n0 = f0 + it * T
            async_copy.wait_group(STAGES - 2)
            _sync()
            st = it & (STAGES - 1)
            st_w = (it + STAGES - 1) & (STAGES - 1)
            nc = gl.minimum(n0 + (STAGES - 1) * T, f1 - T)  # the step whose copies are issued now
            if PAGED:
                co, mo = _page_offs(pgn, nc, cps, mps, NH, PR)
                pgn = _page_of(bt_row, gl.minimum(nc + T, f1 - T), PR)
            else:
                co, mo = nc * (8 * NH), nc * NH
            _issue_copies(kbuf, vbuf, mbuf, st_w, ck, cv, cm, co, mo)
            xk = _smem_codes(kbuf.index(st), KLOAD, NH)
            xv = _smem_codes(vbuf.index(st), VLOAD, NH)
            mb = mbuf.index(st)
            state = _step(xk, xv, _smem_meta(mb, 0, TB, NH), _smem_meta(mb, 1, TB, NH), _smem_meta(mb, 2, TB, NH),
                          _smem_meta(mb, 3, TB, NH), n0, hi, start, qb, c, qs, offc, kdiag, ones, state,
                          TB, MH, NH, False, K8, TP)
        async_copy.wait_group(0)
        if f1 < hr:
            co, mo = _row_offs(f1, bt_row, cps, mps, NH, PAGED, PR)
            xk, xv, ks, kz, vs, vz = _loads_lanes(kl, vl, ksl, kzl, vsl, vzl, f1, co, mo, start, hi, lr, lc, mr, TB,
                                                  NH, True, TP)
            state = _step(xk, xv, ks, kz, vs, vz, f1, hi, start, qb, c, qs, offc, kdiag, ones, state,
                          TB, MH, NH, True, K8, TP)
        m_c = gl.max(state[1], 0) + phi  # per column, -inf stays -inf
        over = gl.where(m_c == float("-inf"), 0.0, m_c - phi)
        run = 0
        if gl.max(gl.where(cvalid, gl.abs(over), 0.0), 0) > DF_LIM:
            # a rerun against the true max (rare: a column's max strayed more than DF_LIM from the first step's)
            phi = gl.where(m_c == float("-inf"), phi, m_c)
            run = 2
            # the first step again, against the new reference
            co, mo = _row_offs(lo, bt_row, cps, mps, NH, PAGED, PR)
            xk, xv, ks, kz, vs, vz = _loads_lanes(kl, vl, ksl, kzl, vsl, vzl, lo, co, mo, start, hi, lr, lc, mr, TB,
                                                  NH, True, TP)
            state = _step(xk, xv, ks, kz, vs, vz, lo, hi, start, qb, c, qs, off - phi, kdiag, ones,
                          _fresh_state(NH, TP), TB, MH, NH, True, K8, TP)
    if PDL:  # the combine may launch once every program is past its loop (an input from m_c orders it there)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $1", "=r,f", [m_c], dtype=gl.int32,
                                  is_pure=False, pack=1)
    # ---- per column -> per query row: the CS column sets (token sets, or TP = 2 the tokens' parity) merged by
    # log-sum-exp ----
    if CS == 1:
        m_r = m_c
        m_b = m_c
    else:  # the row max [MH], and back to columns: m_b[tb * MH + h] = m_r[h]
        m_r = gl.max(gl.reshape(m_c, [CS, MH]), 0)
        m_b = gl.reshape(gl.permute(gl.join(m_r, m_r), [1, 0]), [2 * MH])
        m_b = gl.convert_layout(m_b, gl.SliceLayout(0, MMA))
    # per column: rescale from its reference to the row's max (a column without valid tokens adds nothing; its
    # reference 0 may lie far above a very negative row max, so its factor is set to 0, not exp2(0 - m))
    alpha = gl.where(m_c == float("-inf"), 0.0, gl.exp2(phi - gl.where(m_b == float("-inf"), phi, m_b)))
    lt, mt, zt, acc, sw = state
    l_c = gl.sum(lt, 0) * alpha
    zs = ()
    for g in gl.static_range(NG):
        zs = zs + (gl.sum(zt[g], 0),)
    # the codes' offset 256 sum W of each group (every row of sw_g holds the column sums); then / KP of the chunk's
    # plane (2, 8, 32, 32) and + sum p z of its group
    o = ()
    for i in gl.static_range(4 * NH):
        o = o + (acc[i] - 256.0 * gl.max(sw[i // GC], 0)[None, :],)
    KPINV: gl.constexpr = (0.5, 0.125, 0.03125, 0.03125)
    o2 = ()
    for i in gl.static_range(4 * NH):
        o2 = o2 + ((o[i] * KPINV[i // NH] + zs[i // GC][None, :]) * alpha[None, :],)
    l_r = gl.sum(gl.reshape(l_c, [CS, MH]), 0)
    o3 = ()
    if TP == 2:
        # output row m = 8 bb + 4 e' + w of a plane is byte 4 (4 e' + w) + bb of the code row: token 2j + e', channel
        # 4 w + bb of the plane's 16. Column 4 e + h is kept in the rows of its own token (e' = e), and the two
        # tokens' columns of row h summed: [16 (bb, w), MH]
        rm = gl.arange(0, 32, layout=gl.SliceLayout(1, MMA))
        rn = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
        own = ((rm % 8) // 4)[:, None] == (rn // MH)[None, :]
        for i in gl.static_range(4):
            x = gl.reshape(gl.where(own, o2[i], 0.0), [4, 2, 4, 2, MH])  # bb, e', w, e, h
            o3 = o3 + (gl.reshape(gl.sum(gl.sum(x, 3), 1), [16, MH]),)
    else:
        for i in gl.static_range(4 * NH):
            o3 = o3 + (gl.sum(gl.reshape(o2[i], [32, TB, MH]), 1),)
    # stores: row h < M; output row m of chunk i is channel 32 i + sigma_V(m) = 32 i + 4 (m % 8) + m // 8 (TP = 2:
    # row m = 4 bb + w of plane i, channel 16 i + 4 w + bb)
    if TP == 2:
        OL: gl.constexpr = gl.BlockedLayout([1, 1], [16, 2], [1, 1], [1, 0])
        RW: gl.constexpr = 16
    else:
        OL: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [1, 1], [1, 0])
        RW: gl.constexpr = 32
    o4 = ()
    for i in gl.static_range(4 * NH):
        o4 = o4 + (gl.convert_layout(o3[i], OL),)
    om = gl.arange(0, RW, layout=gl.SliceLayout(1, OL))
    oh = gl.arange(0, MH, layout=gl.SliceLayout(0, OL))
    if TP == 2:
        sig = 4 * (om % 4) + om // 4
    else:
        sig = 4 * (om % 8) + om // 8
    optr = PACC + (part + oh[None, :]) * (128 * NH // TP) + sig[:, None]
    omask = (oh < M)[None, :]
    for i in gl.static_range(4 * NH):
        gl.store(optr + RW * i, o4[i], mask=omask)
    RL: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    rh = gl.arange(0, MH, layout=RL)
    gl.store(PM + part + rh, gl.convert_layout(m_r, RL), mask=rh < M)
    gl.store(PL + part + rh, gl.convert_layout(l_r, RL), mask=rh < M)
    if QFLAG:  # the PDL wait after all (the prologue grid is long done): this grid completes after it, as without QFLAG
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0 $1", "=r,f", [l_r], dtype=gl.int32, is_pure=False,
                                  pack=1)


def gluon_supported(q_rot, k, v, group_size: int, key_mask, meta_words: bool) -> bool:
    """The shapes this kernel serves (the rest: the Triton kernel): head_dim 128 or 256 in groups of 64 channels, and
    head_dim 64 (one group) with <= 4 query rows, or an even number up to 8 (two programs per (row, KV head):
    :func:`~oscar_hf.kernels.plan.gluon_query_groups`).
    ``meta_words``: the bf16 scale / zero of a token are ``D / 128`` aligned 4-byte words (two groups each); at D = 64
    those of a token pair (2j, 2j + 1) are."""
    b, hk, m, d = q_rot.shape
    return (q_rot.is_cuda and cuda_major(q_rot.device) >= 8 and (d in (128, 256) or (d == 64 and (m <= 4 or gluon_query_groups(m, d) > 1)))
            and group_size == 64 and 1 <= m <= 8 and key_mask is None and meta_words
            and k.codes.stride(-1) == 1 and v.codes.stride(-1) == 1
            # token rows of D / 4 bytes: the addressing assumes them
            and k.codes.stride(2) == d // 4 and v.codes.stride(2) == d // 4
            and all(st % 8 == 0 for st in k.codes.stride()[:-1]) and all(st % 4 == 0 for st in v.codes.stride()[:-1])
            and k.codes.data_ptr() % 8 == 0 and v.codes.data_ptr() % 4 == 0)


def launch_history(q_rot, qk_offset, history, partials, n, qk_scale, *, plan, qpre=None, ready=None, paged=None):
    """The history partials ``(pm, pl, pacc)`` of ``q_rot [B, Hk, M, D]`` over ``history`` (``n`` entries bound the
    grid), launched as ``plan`` says. ``qpre``: None or ``(tiles, fields)``, the int8 query operands the prologue
    built; ``ready``: the counters ``[B * Hk]`` its programs raise (``QFLAG``). ``paged``: a ``_PagedRead``."""
    (k, v, start, n_valid), (pm, pl, pacc) = (history.k, history.v, history.start, history.n_valid), partials
    s_hist, s_tot, split_len, stages = plan.s_hist, plan.s_tot, plan.split_len, plan.gluon_stages
    maxnreg, pdl, k8 = plan.gluon_maxnreg, plan.pdl, plan.k8
    b, hk, m, d = q_rot.shape
    assert not (k8 and d != 128), "the int8 key path serves D = 128 only"
    tp = 2 if d == 64 else 1
    qg = gluon_query_groups(m, d)  # (D = 64, 5-8 rows: two programs per (row, KV head), m // 2 rows each)
    mg = m // qg
    assert tp == 1 or (mg <= 4 and split_len % 2 == 0), "D = 64: <= 4 query rows a group, splits of whole code rows"
    z3 = (0, 0, 0)
    pk = {}
    if paged is not None:  # the row strides 0: pages come from the block table; page strides in 4-byte words
        assert n_valid is None and k.codes.stride(0) == v.codes.stride(0) and k.scale.stride(0) == v.scale.stride(0)
        assert paged.page % tokens_per_step(mg, d) == 0, "a step must not straddle pages"
        n_valid = paged.hist_len
        cps, mps = k.codes.stride(0) // 4, k.scale.stride(0) * k.scale.element_size() // 4
        pk = dict(BT=paged.block_table, sbt=paged.block_table.stride(0), cps=cps, mps=mps, PAGED=1,
                  PR=paged.page // tp)
    _hist_kernel[(b * hk * qg, s_hist)](
        q_rot, *k, *v, start, qk_offset, n_valid, pm, pl, pacc,
        n, mg, hk, s_hist, s_tot, split_len, qk_scale,
        *q_rot.stride()[:3],  # then each history tensor's (row, KV head) strides (paged: the row's pages, stride 0)
        *(x for t in (k.codes, k.scale, v.codes, v.scale) for x in (0 if paged is not None else t.stride(0), t.stride(1))),
        *(qk_offset.stride() if qk_offset is not None else z3),
        TB=tokens_per_step(mg, d) // (16 * tp), HAS_OFF=qk_offset is not None, QG=qg,
        N_DEV=n_valid is not None and paged is None,
        STAGES=stages, PDL=int(bool(pdl)), K8=int(bool(k8)), NH=max(d // 128, 1), TP=tp,
        QP8=qpre[0] if qpre else None, QPF=qpre[1] if qpre else None, QPRE=int(bool(qpre and k8)),
        READY=ready, QFLAG=int(ready is not None and bool(qpre and k8) and bool(pdl)), num_warps=1,
        **({"launch_pdl": True} if pdl else {}), **({"maxnreg": maxnreg} if maxnreg else {}), **pk)


settle_cache_keys(globals())  # (plan.settle_cache_keys: the same kernel keys in every process)
