"""The package version (its own module so that modules inside the package can read it without a cycle), and the
Transformers releases ``oscar_hf.serving`` follows."""
from __future__ import annotations

import os

__version__ = "0.1.0"

# The Transformers releases whose continuous-batching internals oscar_hf.serving follows (tests/serving/
# test_transformers_internals.py pins each one it touches): 5.17 - 5.19 (block managers) and 5.20 - 5.25 (sectors);
# setup.cfg's `serving` extra pins the same range. Outside it `import oscar_hf.serving` refuses before it imports any
# of those internals, so that a new release fails a test here instead of serving wrongly;
# OSCAR_SERVING_ANY_TRANSFORMERS=1 lifts the check (at your own risk: the tests above say what it relies on).
SERVING_TRANSFORMERS = ("5.17", "5.26")  # [first, first not covered)


def check_serving_transformers(version: str) -> None:
    """Raise ImportError, saying what to install, when ``version`` is outside :data:`SERVING_TRANSFORMERS` (unless
    lifted, see above)."""
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
