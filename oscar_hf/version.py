"""The package version (its own module: no import cycle), and the Transformers releases ``oscar_hf.serving`` follows."""
from __future__ import annotations

import os

__version__ = "0.1.0"

# The Transformers releases whose continuous-batching internals oscar_hf.serving follows (pinned by
# tests/serving/test_transformers_internals.py and setup.cfg); outside it the import refuses, so that a new release
# fails a test instead of serving wrongly. OSCAR_SERVING_ANY_TRANSFORMERS=1 lifts the check.
SERVING_TRANSFORMERS = ("5.17", "5.26")  # [first, first not covered)


def check_serving_transformers(version: str) -> None:
    """Raise ImportError, saying what to install, when ``version`` is outside :data:`SERVING_TRANSFORMERS`."""
    from packaging.version import Version
    lo, hi = SERVING_TRANSFORMERS
    if Version(lo) <= Version(Version(version).base_version) < Version(hi):
        return
    if os.environ.get("OSCAR_SERVING_ANY_TRANSFORMERS") == "1":
        return
    raise ImportError(
        f"oscar_hf.serving follows the continuous-batching internals of Transformers >={lo},<{hi}; this is {version}. "
        f'Install a release it follows (pip install "oscar-hf[serving]", or "transformers[serving]>={lo},<{hi}"), or '
        "set OSCAR_SERVING_ANY_TRANSFORMERS=1 to try it anyway")
