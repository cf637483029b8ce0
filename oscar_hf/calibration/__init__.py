"""Calibration: text -> attention statistics -> rotations, offsets and clip ratios (an
:class:`~oscar_hf.rotations.OscarRotations` artifact), then the retrieval heads' scores (:mod:`.retrieval_heads`) and
the cache settings (:mod:`.settings`). The passes, centering and shared rotations: docs/calibration.md."""
from .options import CalibrationOptions
from .pipeline import METHODS, VALUE_TARGETS, calibrate
from .report import calibration_report, plot_settings, plot_spectra
from .retrieval_heads import find_retrieval_heads
from .search import CLIP_GRID, attention_error, build_candidates, evaluate_candidates
from .settings import choose_settings
from .stats import CalibrationStats, collect_statistics

__all__ = ["calibrate", "CalibrationOptions", "choose_settings", "attention_error", "calibration_report",
    "plot_settings", "plot_spectra", "find_retrieval_heads", "collect_statistics", "build_candidates",
    "evaluate_candidates", "CalibrationStats", "CLIP_GRID", "METHODS", "VALUE_TARGETS"]
