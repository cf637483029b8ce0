"""A clone of the repository needs nothing beside it: the text the demo, tests and evaluations read ships inside
the tracked tree, and a copy of that tree with no sibling folders finds it there."""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from oscar_hf.eval.models import WIKITEXT_FILE

REPO = Path(__file__).resolve().parent.parent


def tracked_files() -> list[str]:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: nothing tracked to copy")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return [f for f in out.decode().split("\0") if f]


def test_shipped_text_is_the_file_its_readme_names():
    readme = (WIKITEXT_FILE.parent / "README.md").read_text(encoding="utf-8")
    digest = hashlib.sha256(WIKITEXT_FILE.read_bytes()).hexdigest()
    assert digest in re.findall(r"[0-9a-f]{64}", readme), "oscar_hf/texts/README.md names another SHA-256"
    assert f"{WIKITEXT_FILE.stat().st_size:,} bytes" in readme
    assert "CC BY-SA" in readme  # its license travels with it


def test_a_copy_of_the_tracked_tree_reads_its_own_text(tmp_path):
    """Copy ``git ls-files`` into an empty folder and import the data from there, with no ``OSCAR_WIKITEXT``: the
    path must lie inside the copy (a lookup of a sibling ``shared/`` or of this checkout fails here)."""
    clone = tmp_path / "clone"
    files = tracked_files()
    assert "oscar_hf/texts/wikitext-2-raw-test.txt" in files, "the shipped text is not tracked"
    for rel in files:
        dst = clone / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if (REPO / rel).is_file():
            shutil.copy2(REPO / rel, dst)
    probe = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('clone_models', 'eval/models.py')\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "p = m.wikitext_path(); print(p.resolve()); print(len(p.read_text(encoding='utf-8')))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OSCAR_WIKITEXT"}
    res = subprocess.run([sys.executable, "-P", "-c", probe], cwd=clone, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    path, n_chars = res.stdout.split()
    assert Path(path).is_relative_to(clone.resolve()), f"the copy read {path}, outside itself"
    assert int(n_chars) == len(WIKITEXT_FILE.read_text(encoding="utf-8"))


def test_wikitext_override_must_name_a_file(monkeypatch, tmp_path):
    from oscar_hf.eval.models import wikitext_path

    monkeypatch.setenv("OSCAR_WIKITEXT", str(tmp_path / "missing.txt"))
    with pytest.raises(OSError, match="OSCAR_WIKITEXT"):
        wikitext_path()
    own = tmp_path / "own.txt"
    own.write_text("my text")
    monkeypatch.setenv("OSCAR_WIKITEXT", str(own))
    assert wikitext_path() == own
