"""Installation layout: `kernels/` is `oscar_hf.kernels`, never a top-level `kernels` module."""
import importlib.util
from pathlib import Path

import oscar_hf
import oscar_hf.eval
import oscar_hf.kernels

REPO = Path(__file__).resolve().parent.parent


def test_kernels_installed_under_oscar_hf():
    assert Path(oscar_hf.kernels.__file__).resolve().parent == REPO / "kernels"
    assert Path(oscar_hf.eval.__file__).resolve().parent == REPO / "eval"


def test_no_top_level_kernels_module_shadows_hugging_face():
    spec = importlib.util.find_spec("kernels")
    if spec is not None:  # Hugging Face's `kernels` may be installed; it must not be our directory
        assert REPO / "kernels" not in [Path(p).resolve() for p in (spec.submodule_search_locations or [])]
    from transformers.utils import import_utils

    if spec is None:
        assert not import_utils.is_kernels_available()


def test_public_api():
    for name in ("OscarCache", "OscarConfig", "OscarRotations", "enable_oscar", "disable_oscar"):
        assert hasattr(oscar_hf, name)
