"""The package version (its own module: no import cycle), and the Transformers releases ``oscar_hf.serving`` follows."""
from __future__ import annotations

import os

__version__ = "0.1.0"

# The Transformers releases whose continuous-batching internals oscar_hf.serving follows (pinned by
# tests/serving/test_transformers_internals.py and setup.cfg); outside it the import refuses, so that a new release
# fails a test instead of serving wrongly. OSCAR_SERVING_ANY_TRANSFORMERS=1 lifts the check.
SERVING_TRANSFORMERS = ("5.17", "5.26")  # [first, first not covered)
# releases inside that range it does not follow: 5.18 matches requests to its own shared prefix blocks in a way the
# store does not see (its requests arrive at a position the store never wrote; 5.17 and 5.19+ pass tests/serving)
SERVING_EXCLUDED = ("5.18",)


def check_serving_transformers(version: str) -> None:
    """Raise ImportError, saying what to install, when ``version`` is outside :data:`SERVING_TRANSFORMERS`."""
    from packaging.version import Version
    lo, hi = SERVING_TRANSFORMERS
    v = Version(Version(version).base_version)
    excluded = any(v.release[:2] == Version(x).release[:2] for x in SERVING_EXCLUDED)
    if Version(lo) <= v < Version(hi) and not excluded:
        return
    if os.environ.get("OSCAR_SERVING_ANY_TRANSFORMERS") == "1":
        return
    raise ImportError(
        f"oscar_hf.serving follows the continuous-batching internals of Transformers >={lo},<{hi} but "
        f"{', '.join(x + '.*' for x in SERVING_EXCLUDED)}; this is {version}. "
        f'Install a release it follows (pip install "oscar-hf[serving]", or "transformers[serving]>={lo},<{hi}'
        f'{"".join(",!=" + x + ".*" for x in SERVING_EXCLUDED)}"), or '
        "set OSCAR_SERVING_ANY_TRANSFORMERS=1 to try it anyway")
