"""The cache settings chosen per model by next-token KL on held-out windows plus the confident greedy mismatches on a
copy of a novel passage flushed to the history (the recall term), within a memory budget
(``OscarConfig.stored_bits``). The search and its constants: docs/quality.md, "Settings chosen per model by
calibration"."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import torch

from ..config import CHOSEN_FIELDS, FULL_LAYER_TYPES, OscarConfig
from ..rotations import OscarRotations, ranked_heads
from .hooks import progress_bar
from .selection import CONFIDENT, SCORED_TOKENS, greedy_mismatch, next_token_kl, reference_log_probs

DEFAULT_BUDGET_BITS = 3.5  # today's defaults cost 3.476 on SmolLM2 at 8192 tokens (OscarConfig.stored_bits)
DEFAULT_TARGET_CONTEXT = 32768  # capped by the model's max_position_embeddings
MARGIN = 0.02  # relative KL gain an alternative needs to replace the incumbent
WINDOW_SHARE = 0.25  # a window candidate's sink + recent may cover at most this share of the held-out prompt
# wide windows tried besides the incumbent's halves and doubles, up to the authors' 128 / 2048 (scored only on held-out
# prompts of >= (sink + recent) / WINDOW_SHARE tokens: 8704 for (128, 2048))
WIDE_WINDOWS = ((128, 512), (128, 768), (128, 1024), (128, 2048))
HEAD_WIDTHS = (8, 4)  # retrieval heads' storage searched (INT8, INT4; 16 costs 2x INT8 and was not better on needles)
GROUP_SIZES = (32, 64, 128, None)  # None: head_dim (one group per head); those that do not divide it are left out
KEY_GROUP_STEPS = 1  # 3-bit keys are tried at the incumbent's group size and this many coarser ones
PRECISE_LAYERS = (1, 2, 4)  # numbers of layers kept precise (all their KV heads at the heads' width) tried, in order
# The recall term: each held-out window's first c = min(RECALL_PROMPT, its prompt) tokens, then a verbatim copy of
# min(SCORED_TOKENS, c / 4) of them from c / 4 on, that passage's tokens put in a seeded random order where they stand
# (a novel passage: the model cannot predict it from what it knows, only read it back from the cache's rows, as the
# retention probe's passages written for it); the share of the copy's tokens where the model is sure of its next token
# (top probability >= selection.CONFIDENT) but the cache's greedy choice differs: a failed copy of a passage flushed to
# the INT2 history long before it is recalled. On Gemma-3-270M the next-token KL alone, the mismatch over every copied
# token and the copy of unpermuted WikiText all ranked settings against verbatim retention after the flush; the
# confident flips on a novel copy ranked them with it (docs/quality.md "The recall term"). A candidate's sink + recent
# is at most a quarter of the prompt (WINDOW_SHARE), so the passage is history for every candidate.
RECALL_PROMPT = 4096
OBJECTIVE = ("next_kl", "recall_confident")  # the parts of objective()'s record the search minimizes the sum of


def check_budget(budget_bits, target_context) -> None:
    """ValueError for a budget that is not a number of bits in (2, 16] or a context that is not a positive int."""
    if isinstance(budget_bits, bool) or not isinstance(budget_bits, (int, float)) or not 2.0 < budget_bits <= 16.0:
        raise ValueError(f"budget_bits must be a number of bits per cached element in (2, 16], got {budget_bits!r}")
    if target_context is not None and (isinstance(target_context, bool) or not isinstance(target_context, int)
                                       or target_context < 1):
        raise ValueError(f"target_context must be a positive int of tokens (or None), got {target_context!r}")


def recall_windows(windows: Sequence[torch.Tensor], scored: int = SCORED_TOKENS) -> list[tuple[torch.Tensor, int]]:
    """The recall term's ``(ids, scored)`` windows: of each held-out ``[n]`` window, its first
    ``c = min(RECALL_PROMPT, n - scored)`` tokens with the ``min(scored, c // 4)`` from ``c // 4`` on permuted (seeded
    by the window's index: the same passage for every candidate), then a copy of that passage (the copy scored).
    Windows too short for a 16-token passage give none."""
    out = []
    for i, w in enumerate(windows):
        c = min(RECALL_PROMPT, int(w.numel()) - scored)
        n = min(scored, c // 4)
        if n >= 16:
            prompt = w[:c].clone()
            order = torch.randperm(n, generator=torch.Generator().manual_seed(i)).to(w.device)
            passage = prompt[c // 4 : c // 4 + n] = prompt[c // 4 : c // 4 + n][order]
            out.append((torch.cat([prompt, passage]), n))
    return out


def check_recall_window(config: OscarConfig, window: torch.Tensor, scored: int) -> None:
    """ValueError where ``config``'s sink or recent window would hold part of a recall window's passage (it must be
    INT2 history when it is copied)."""
    c = int(window.numel()) - scored
    if config.sink > c // 4 or config.recent > c - c // 4 - scored:
        raise ValueError(f"window=({config.sink}, {config.recent}) covers part of the recall term's passage (tokens "
                         f"{c // 4}..{c // 4 + scored} of a {c}-token prompt)")


@dataclasses.dataclass
class Trial:
    """One setting scored: what changed, the config, its budget bits and objective (``kl``: the next-token KL plus
    the recall term's confident greedy mismatch, each given apart where the search computed them)."""

    name: str
    config: OscarConfig
    bits: float
    kl: float
    parts: dict | None = None  # {"next_kl": .., "recall_confident": .., "recall_mismatch" / "recall_kl" (reported)}

    def record(self) -> dict:
        c = self.config
        return {"name": self.name, "bits": round(self.bits, 4), "kl": self.kl, **(self.parts or {}),
                "sink": c.sink, "recent": c.recent, "group_size": c.group_size, "quantizer": c.quantizer,
                "key_bits": c.key_bits, "heads": len(c.retrieval_heads), "head_bits": c.retrieval_bits}


class _Space:
    """Retrieval heads ranked by score, layers by held-out error, and :meth:`fit` of a setting to the budget."""

    def __init__(self, rotations: OscarRotations, base: OscarConfig, budget_bits: float, target_context: int):
        fp = self.fp = rotations.fingerprint
        self.hk, self.budget, self.context = fp.num_key_value_heads, float(budget_bits), int(target_context)
        self.layers = [i for i in sorted(rotations.layers) if fp.layer_types[i] in FULL_LAYER_TYPES]
        if not self.layers:
            raise ValueError("choose_settings: the artifact has no quantized (full-attention) layer")
        scores = rotations.retrieval_scores  # [num_layers, Hk] or None
        self.heads: list[tuple[int, int]] = []  # the retrieval heads (score >= threshold), best first
        if scores is not None:
            self.heads = [p for p in ranked_heads(scores, self.layers) if scores[p] >= base.retrieval_threshold]
        held = rotations.metadata.get("heldout_error") or {}
        err = {int(i): e.get("k_rel", 0.0) + e.get("v_rel", 0.0) for i, e in held.items() if int(i) in self.layers}
        self.ranked_layers = sorted(err, key=lambda i: -err[i])  # largest held-out attention error first
        self.floor = 0

    def bits(self, config: OscarConfig) -> float:
        return config.stored_bits(self.fp, self.layers, self.context)

    def with_heads(self, config: OscarConfig, n: int, precise: int = 0) -> OscarConfig:
        """``config`` keeping every KV head of the ``precise`` worst layers and the ``n`` best retrieval heads."""
        whole = {(i, h) for i in self.ranked_layers[:precise] for h in range(self.hk)}
        return config.replace(retrieval_heads=tuple(sorted(whole | set(self.heads[:n]))))

    def fit(self, config: OscarConfig, precise: int = 0) -> OscarConfig | None:
        """:meth:`with_heads` with as many retrieval heads as fit the budget; None below :attr:`floor`."""
        retrieval = set(self.heads)
        for n in range(len(self.heads), -1, -1):  # most heads first
            c = self.with_heads(config, n, precise)
            if len(set(c.retrieval_heads) & retrieval) < self.floor:
                return None
            if self.bits(c) <= self.budget + 1e-9:
                return c
        return None


def default_target_context(model) -> int:
    """The context the budget is priced at by default: :data:`DEFAULT_TARGET_CONTEXT`, capped by the model's
    ``max_position_embeddings``."""
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    return int(min(DEFAULT_TARGET_CONTEXT, limit)) if limit else DEFAULT_TARGET_CONTEXT


def key_groups(group_size: int, sizes: Sequence[int]) -> list[int]:
    """The group sizes 3-bit keys are tried at: ``group_size`` and the next :data:`KEY_GROUP_STEPS` coarser ones."""
    return [g for g in sizes if g >= group_size][: 1 + KEY_GROUP_STEPS]


def value_key_groups(group_size: int, sizes: Sequence[int]) -> list[int]:
    """The key groups 3-bit keys are tried at beside values at a coarser group: ``group_size`` and the next finer."""
    return [g for g in sizes if g <= group_size][-2:]


def window_candidates(sink: int, recent: int, prompt: int) -> list[tuple[int, int]]:
    """``(sink, recent)`` halved and doubled, then :data:`WIDE_WINDOWS`, each with
    ``sink + recent <= WINDOW_SHARE * prompt``."""
    out = []
    for s, r in ((sink // 2, recent // 2), (sink, recent // 2), (sink * 2, recent), (sink, recent * 2),
                 (sink * 2, recent * 2), *WIDE_WINDOWS):
        if r >= 1 and (s, r) != (sink, recent) and (s, r) not in out and s + r <= WINDOW_SHARE * prompt:
            out.append((s, r))
    return out


def choose_settings(model, rotations: OscarRotations, windows: Sequence[torch.Tensor] | None = None, *,
                    budget_bits: float = DEFAULT_BUDGET_BITS, target_context: int | None = None,
                    base: OscarConfig | None = None, margin: float = MARGIN, progress: bool = True,
                    score: Callable[[OscarConfig], float] | None = None, recall: bool = True) -> dict:
    """Search the cache settings and return the artifact's ``metadata["settings"]`` entry: ``chosen``
    (:data:`~oscar_hf.config.CHOSEN_FIELDS`), its ``bits`` and ``kl``, the budget, ``tried`` and ``over_budget``.
    ``windows``: held-out ``[n]`` ids (512 scored, the rest prompt); ``base``: where the search starts; ``score``:
    ``config -> objective`` in place of :func:`objective` over ``windows``; ``recall``: the objective's recall term
    (False: the next-token KL alone); ``target_context`` None: :data:`DEFAULT_TARGET_CONTEXT` capped by the model's
    ``max_position_embeddings``."""
    t0 = time.perf_counter()
    if target_context is None:
        target_context = default_target_context(model)
    check_budget(budget_bits, target_context)
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must lie in [0, 1), got {margin!r}")
    base = (base or OscarConfig()).for_head_dim(rotations.fingerprint.head_dim)
    space = _Space(rotations, base, budget_bits, target_context)
    parts: dict = {}  # the last scored config's objective in parts (the default score's)
    if score is None:
        if not windows:
            raise ValueError("choose_settings needs held-out windows (or a score function)")
        measure = objective(model, rotations, windows, recall)

        def score(config: OscarConfig) -> float:
            parts.clear()
            parts.update(measure(config))
            return sum(parts.get(k, 0.0) for k in OBJECTIVE)

    prompt = min(int(w.numel()) for w in windows) - SCORED_TOKENS if windows else 1 << 30
    n_copies = len(recall_windows(windows)) if recall and windows else 0  # (the objective's recall windows)
    hd = space.fp.head_dim
    tried: list[Trial] = []
    over: list[dict] = []
    # the group sizes dividing head_dim; the group step tries all but the defaults' (the quantizer step keeps it)
    sizes = [g for g in dict.fromkeys(hd if g is None else g for g in GROUP_SIZES) if g <= hd and hd % g == 0]
    groups = [g for g in sizes if g != base.group_size]
    # the bar counts settings scored or over budget: defaults, quantizer, group sizes, 3-bit keys (and with coarser
    # value groups), windows, head width, layers
    n_plan = (2 + len(groups) + len(key_groups(base.group_size, sizes))
              + sum(gv > g for g in value_key_groups(base.group_size, sizes) for gv in sizes)
              + len(window_candidates(base.sink, base.recent, prompt)) + (1 if space.heads else 0)
              + min(len(PRECISE_LAYERS), len(space.ranked_layers)))

    def run(name: str, config: OscarConfig | None, unfitted: OscarConfig, precise: int = 0) -> Trial | None:
        if config is None:  # over the budget even with the fewest retrieval heads allowed
            over.append({"name": name, "bits": round(space.bits(space.with_heads(unfitted, space.floor, precise)), 4)})
        else:
            tried.append(Trial(name, config, space.bits(config), float(score(config)), dict(parts) or None))
        bar.update(1)
        return None if config is None else tried[-1]

    with progress_bar(progress, n_plan, "OSCAR cache settings") as bar:
        # today's defaults, their heads fitted to the budget; that head count is the floor every candidate keeps
        start = base.replace(retrieval_bits=HEAD_WIDTHS[0])
        inc_cfg = space.fit(start)
        if inc_cfg is None:
            raise ValueError(f"budget_bits={budget_bits} at {target_context} tokens is below what the defaults cost "
                             f"without retrieval heads ({space.bits(space.with_heads(start, 0)):.3f} bits)")
        space.floor = sum(p in set(space.heads) for p in inc_cfg.retrieval_heads)
        inc = run("defaults", inc_cfg, start)
        precise = 0

        def step(options: list[tuple[str, OscarConfig, int]]) -> bool:
            """Score ``(name, unfitted config, precise layers)``; the best replaces the incumbent by > margin."""
            nonlocal inc, precise
            best = None
            for name, cfg, p in options:
                t = run(name, space.fit(cfg, p), cfg, p)
                if t is not None and (best is None or t.kl < best[0].kl):
                    best = (t, p)
            if best is not None and best[0].kl < inc.kl * (1.0 - margin):
                inc, precise = best
                return True
            return False

        unfit = lambda: inc.config.replace(retrieval_heads=())  # noqa: E731  (the incumbent, heads refitted)

        def window_options(s: int, r: int) -> list[tuple[str, OscarConfig, int]]:
            """Window ``(s, r)`` at the incumbent's group size or, over the budget there, at the finest coarser one
            that fits: a wide window priced at target_context is paid for by the history's metadata (Gemma-3-270M's
            (128, 2048) fits 3.5 bits at 32K with group 64, not 32). With 3-bit keys whose values have a group of
            their own, also the keys at the next finer group where that fits: a finer key group and a narrower
            window are one move that neither step makes alone (Gemma-3-270M: keys at 32 with (128, 768), docs/
            quality.md "The recall term")."""
            cfg = unfit().replace(sink=s, recent=r)
            out = [(f"window=({s}, {r})", cfg, precise)]
            if space.fit(cfg, precise) is None:
                for g in (x for x in sizes if x > cfg.group_size):
                    if space.fit(cfg.replace(group_size=g), precise) is not None:
                        out = [(f"window=({s}, {r}), group_size={g}", cfg.replace(group_size=g), precise)]
                        break
            finer = [g for g in sizes if g < cfg.group_size][-1:]
            if cfg.key_bits == 3 and cfg.value_group_size and finer and space.fit(
                    cfg.replace(group_size=finer[0]), precise) is not None:
                out.append((f"window=({s}, {r}), group_size={finer[0]}", cfg.replace(group_size=finer[0]), precise))
            return out

        step([(f"quantizer={q}", unfit().replace(quantizer=q), precise) for q in ("minmax", "std")
              if q != inc.config.quantizer and (q == "minmax" or inc.config.key_bits == 2)])  # (std: 4 levels)
        step([(f"group_size={g}", unfit().replace(group_size=g), precise) for g in groups])
        # 3-bit keys (the keys carry most of the INT2 loss), at the incumbent's group size and the coarser ones that
        # pay for the key's extra bit
        if inc.config.key_bits == 2:
            step([(f"key_bits=3, group_size={g}", unfit().replace(key_bits=3, quantizer="minmax", group_size=g),
                   precise) for g in key_groups(inc.config.group_size, sizes)])
        # 3-bit keys at the incumbent's group or the next finer one with the values at each coarser group, whose
        # metadata pays for part of the keys' bit (Gemma-3-270M's needles: keys at group 32 and values at 64 kept
        # them where both at 64 did not, docs/quality.md "Three-bit keys")
        step([(f"key_bits=3, group_size={g}, value_group_size={gv}",
               unfit().replace(key_bits=3, quantizer="minmax", group_size=g, value_group_size=gv), precise)
              for g in value_key_groups(inc.config.group_size, sizes) for gv in sizes if gv > g])
        windows_now = window_candidates(inc.config.sink, inc.config.recent, prompt)
        options = [o for s, r in windows_now for o in window_options(s, r)]
        if isinstance(getattr(bar, "total", None), int):  # (a disabled bar has none) the finer key groups beside them
            bar.total += len(options) - len(windows_now)
        step(options)
        if space.heads or precise:  # (the width of no head changes nothing)
            step([(f"heads as INT{w}", unfit().replace(retrieval_bits=w), precise) for w in HEAD_WIDTHS
                  if w != inc.config.retrieval_bits])
        # layers kept precise (greedy: more while it pays), worst held-out attention error first
        for n in PRECISE_LAYERS:
            if n <= len(space.ranked_layers) and n > precise:
                if not step([(f"{n} precise layers {space.ranked_layers[:n]}", unfit(), n)]):
                    break
    chosen = {k: getattr(inc.config, k) for k in CHOSEN_FIELDS}
    chosen["retrieval_heads"] = [list(p) for p in chosen["retrieval_heads"]]  # JSON-able
    return {
        "budget_bits": float(budget_bits),
        "target_context": int(target_context),
        "budget_definition": "average stored bits per cached K/V element over the quantized layers at target_context "
                             "tokens (OscarConfig.stored_bits: windows at 16 bits, INT2 codes + scale/zero, "
                             "retrieval heads at their width)",
        "objective": f"mean next-token KL through OscarCache, last {SCORED_TOKENS} tokens of "
                     f"{len(windows) if windows else 0} held-out window(s) of "
                     f"{[int(w.numel()) for w in windows] if windows else []} tokens"
                     + (f", plus the recall term: the share of greedy mismatches where the model is sure (top token "
                        f"p >= {CONFIDENT}) on a copy of a passage, its tokens permuted, from a quarter into each "
                        f"window's first {RECALL_PROMPT} tokens at most ({n_copies} window(s))" if n_copies else ""),
        "margin": margin,
        "retrieval_heads_floor": space.floor,
        "precise_layers": space.ranked_layers[:precise],
        "chosen": chosen,
        "chosen_name": inc.name,
        "bits": round(inc.bits, 4),
        "kl": inc.kl,
        "tried": [t.record() for t in tried],
        "over_budget": over,
        "time_s": round(time.perf_counter() - t0, 2)}


def objective(model, rotations: OscarRotations, windows: Sequence[torch.Tensor], recall: bool = True
              ) -> Callable[[OscarConfig], dict]:
    """``config -> {"next_kl": .., "recall_confident": .., "recall_mismatch": .., "recall_kl": ..}``: the mean
    next-token KL over ``windows``' last :data:`SCORED_TOKENS` tokens and (``recall``, where a window is long enough)
    the share of their :func:`recall_windows`' copied tokens where the model is confident and greedy decoding through
    the cache parts from it (``selection.Recall.confident``; windows weighted by their copies' lengths); the search
    minimizes their sum (:data:`OBJECTIVE`). ``recall_mismatch``, the share over every copied token, and
    ``recall_kl``, the copy's mean KL, are reported, not minimized. The references are computed once, here."""
    copies = recall_windows(windows) if recall else []
    refs = [reference_log_probs(model, w, SCORED_TOKENS) for w in windows]
    copy_refs = [reference_log_probs(model, w, n) for w, n in copies]

    def measure(config: OscarConfig) -> dict:
        out = {"next_kl": sum(next_token_kl(model, rotations, w, reference=r, config=config)
                              for w, r in zip(windows, refs)) / len(windows)}
        if copies:
            for w, n in copies:
                check_recall_window(config, w, n)
            scores = [greedy_mismatch(model, rotations, w, config, n, r) for (w, n), r in zip(copies, copy_refs)]
            total = sum(n for _, n in copies)
            out["recall_mismatch"] = sum(r.mismatch * n for r, (_, n) in zip(scores, copies)) / total
            out["recall_kl"] = sum(r.kl * n for r, (_, n) in zip(scores, copies)) / total
            out["recall_confident"] = sum(r.confident * n for r, (_, n) in zip(scores, copies)) / total
        return out

    return measure


def kl_frontier(tried: Sequence[dict]) -> list[dict]:
    """The KL-vs-bits frontier of ``tried`` records, cheapest first: those no cheaper one beats."""
    front: list[dict] = []
    for t in sorted(tried, key=lambda t: (t["bits"], t["kl"])):
        if not front or t["kl"] < front[-1]["kl"]:
            front.append(t)
    return front


def settings_summary(entry: dict) -> list[str]:
    """Report lines of a ``metadata["settings"]`` entry (:func:`oscar_hf.calibration.calibration_report`)."""
    c = entry["chosen"]
    width = "in the model dtype" if c["retrieval_bits"] == 16 else f"as INT{c['retrieval_bits']}"
    vg = f" (values {c['value_group_size']})" if c.get("value_group_size") not in (None, c["group_size"]) else ""
    lines = [f"  cache settings chosen by next-token KL within {entry['budget_bits']:g} bits per cached element at "
             f"{entry['target_context']} tokens: sink {c['sink']} / recent {c['recent']}, group_size "
             f"{c['group_size']}{vg}, quantizer {c['quantizer']}, {c.get('key_bits', 2)}-bit keys, "
             f"{len(c['retrieval_heads'])} retrieval heads "
             f"{width} ({entry['chosen_name']}: {entry['bits']:.3f} bits, KL {entry['kl']:.4g}; search "
             f"{entry['time_s']} s; {entry['objective']})"]
    if entry.get("precise_layers"):
        lines.append(f"    layers kept precise (all their KV heads {width}): {entry['precise_layers']}")
    for t in entry["tried"]:
        mark = "  (kept)" if t["name"] == entry["chosen_name"] else ""
        # the recall part the objective added (the confident flips; the whole mismatch in artifacts before 2026-12-06)
        split = f" (next {t['next_kl']:.4g} + recall {t['kl'] - t['next_kl']:.4g})" if "recall_mismatch" in t else ""
        lines.append(f"    tried {t['name']:<36} KL {t['kl']:.4g}{split}  {t['bits']:.3f} bits  {t['heads']} heads "
                     f"INT{t['head_bits']}{mark}")
    for o in entry.get("over_budget", []):
        lines.append(f"    not tried {o['name']:<32} {o['bits']:.3f} bits with "
                     f"{entry['retrieval_heads_floor']} retrieval heads: over budget")
    return lines
