""":class:`CalibrationOptions`: the keywords of :func:`~oscar_hf.calibration.calibrate`, checked at construction."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .retrieval_heads import LENGTHS, PROBES
from .search import CLIP_GRID, META_DTYPES, center_modes
from .settings import DEFAULT_BUDGET_BITS, check_budget

METHODS = ("oscar", "pca-kv", "hadamard", "identity", "auto")
VALUE_TARGETS = ("sst", "score-weighted")


@dataclasses.dataclass(frozen=True)
class CalibrationOptions:
    """The keywords of :func:`~oscar_hf.calibration.calibrate`; each option in full: docs/calibration.md, "Options"."""

    method: str = "auto"  # "oscar", "pca-kv", "hadamard", "identity" or "auto" (per layer / KV head, then by KL)
    tokens: int = 8192  # statistics tokens, in ceil(tokens / seq_len) windows from the start of the text
    seq_len: int = 2048  # tokens per calibration window
    group_size: int | str | None = "auto"  # the group size the clips are chosen for; None: head_dim
    center: bool | str = True  # store and use mu_K / mu_V; "auto": per layer, KV head and K/V by held-out error
    value_target: str = "sst"  # "sst" (exact C_S) or "score-weighted" (the reference code's target)
    clip_grid: Sequence[float] | None = CLIP_GRID  # clip ratios searched per layer; None or one value: no search
    holdout_fraction: float = 0.25  # held-out windows as a fraction of the statistics windows, at least one
    batch_size: int = 1  # windows per forward
    progress: bool = True  # tqdm bar
    meta_dtype: str = "bfloat16"  # dtype of scale / zero during the clip search
    query_samples: int = 128  # queries per held-out sequence whose attention probabilities weigh the errors
    window: tuple[int, int] | None = (64, 256)  # the cache's (sink, recent); None: every pair counts
    metadata: dict | None = None  # extra JSON-able entries for the artifact's metadata
    share_rotation_across_heads: bool = False  # one R_K / R_V per layer from its heads' pooled statistics
    clips: tuple[float, float] | None = None  # fixed (clip_k, clip_v) for every layer; overrides clip_grid
    retrieval_probes: int = PROBES  # probes scoring every KV head's retrieval (text input); 0: none
    retrieval_lengths: Sequence[int] = LENGTHS  # probe lengths in tokens (beyond the model's context: dropped)
    select_by_kl: bool = True  # method="auto"'s end-to-end check by next-token KL
    choose_settings: bool = True  # choose the cache settings by next-token KL within budget_bits
    budget_bits: float = DEFAULT_BUDGET_BITS  # the budget in OscarConfig.stored_bits at target_context tokens
    target_context: int | None = None  # the context the budget is priced at; None: min(32768, the model's)

    def __post_init__(self):
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731  (frozen: normalize in place)
        if isinstance(self.meta_dtype, torch.dtype):
            put("meta_dtype", str(self.meta_dtype).removeprefix("torch."))
        for name, allowed in (("method", METHODS), ("value_target", VALUE_TARGETS),
                              ("meta_dtype", sorted(META_DTYPES))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        probes = self.retrieval_probes
        if isinstance(probes, bool) or not isinstance(probes, int) or probes < 0:
            raise ValueError(f"retrieval_probes must be an int >= 0, got {probes!r}")
        if not isinstance(self.choose_settings, bool):
            raise ValueError(f"choose_settings must be True or False, got {self.choose_settings!r}")
        check_budget(self.budget_bits, self.target_context)
        center_modes(self.center)
        if not 0.0 < self.holdout_fraction <= 1.0:
            raise ValueError(f"holdout_fraction must lie in (0, 1], got {self.holdout_fraction}")
        if self.batch_size < 1 or self.tokens < 2 or self.seq_len < 2:
            raise ValueError("batch_size must be >= 1, tokens and seq_len >= 2")
        clips = self.clips
        if clips is not None:
            if isinstance(clips, (str, bytes)) or len(clips) != 2:
                raise ValueError(f"clips must be a (clip_k, clip_v) pair, got {clips!r}")
            put("clips", (float(clips[0]), float(clips[1])))
            put("clip_grid", None)
        if any(not 0.0 < c <= 1.0 for c in self.grid + (self.clips or ())):
            raise ValueError(f"clip ratios must lie in (0, 1], got {self.clips or self.clip_grid}")
        if isinstance(self.group_size, str) and self.group_size != "auto":
            raise ValueError(f"group_size must be an int, None (head_dim) or 'auto', got {self.group_size!r}")
        if self.window is not None:
            put("window", (int(self.window[0]), int(self.window[1])))
            if self.window[0] < 0 or self.window[1] < 0:
                raise ValueError(f"window=(sink, recent) must be non-negative, got {self.window}")

    @property
    def grid(self) -> tuple[float, ...]:
        """The clip ratios searched, ascending (one value: no search)."""
        return tuple(sorted({round(float(c), 6) for c in (self.clip_grid or (1.0,))}))

    @property
    def need_holdout(self) -> bool:
        """Whether a choice is made on held-out windows (a clip search, ``method`` or ``center`` "auto")."""
        return self.method == "auto" or len(self.grid) > 1 or self.center == "auto"

    @property
    def need_score_weighted(self) -> bool:
        """Whether the statistics take the second, score-weighted pass over the same windows."""
        return self.method == "auto" or (self.method == "oscar" and self.value_target == "score-weighted")

    def replace(self, **overrides) -> "CalibrationOptions":
        return dataclasses.replace(self, **overrides) if overrides else self
