"""The user scripts (``scripts/*.py``, not a package) imported as modules, for in-process CLI tests."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def import_script(name: str):
    """``scripts/<name>.py`` as a module (its ``main(argv)`` is what the command line runs)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)
