"""The kernels' plain-Python host helpers (``oscar_hf.kernels``) agree with Triton's own."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from script_utils import import_benchmark

triton = pytest.importorskip("triton")
from oscar_hf.kernels import cdiv, next_pow2  # noqa: E402


@given(st.integers(0, 1 << 40), st.integers(1, 1 << 20))
def test_cdiv_matches_triton(a, b):
    assert cdiv(a, b) == triton.cdiv(a, b) == (a + b - 1) // b


@given(st.integers(1, 1 << 40))
def test_next_pow2_matches_triton(n):
    p = next_pow2(n)
    assert p == triton.next_power_of_2(n)
    assert p >= n and p & (p - 1) == 0 and (p == 1 or p // 2 < n)


@given(st.integers(0, 1 << 20), st.floats(0.0, 0.5))
def test_pow2_below_within(s, slack):
    """The split count's rounding: ``s`` itself, or the largest power of two below it when at most ``slack * s``
    fewer."""
    from oscar_hf.kernels.plan import pow2_below_within

    r = pow2_below_within(s, slack)
    p = next_pow2(s + 1) // 2 if s else 0  # the largest power of two <= s
    assert r in (s, p)
    assert r == s or (p < s and s - p <= slack * s)
    assert (r == p) or s == p or s - p > slack * s


ROOT = Path(__file__).resolve().parents[2]


def _spy_savefig(monkeypatch, record):
    """Figure.savefig that first appends ``record(fig)`` to the returned list (matplotlib needed)."""
    plt = pytest.importorskip("matplotlib.pyplot")
    seen = []
    real_savefig = plt.Figure.savefig

    def spy(fig, *a, **kw):
        seen.append(record(fig))
        return real_savefig(fig, *a, **kw)

    monkeypatch.setattr(plt.Figure, "savefig", spy)
    return seen


@pytest.mark.parametrize("name", ["kernels_h100.json", "kernels_h200.json"])
def test_bench_kernels_plot(tmp_path, monkeypatch, name):
    """The kernel benchmark's plot (``benchmarks/bench_kernels.py --plot``, on any machine) from a committed result:
    the PNG is written beside the JSON and has one speedup line more per batch size where the result holds the
    back-to-back graph timing."""
    import json
    import shutil

    src = ROOT / "benchmarks" / "results" / name
    shutil.copy(src, tmp_path / name)
    bk = import_benchmark("bench_kernels")
    lines = _spy_savefig(monkeypatch, lambda fig: len(fig.axes[0].get_lines()))
    bk.plot(str(tmp_path / name))
    png = tmp_path / name.replace(".json", "_speedup.png")
    assert png.stat().st_size > 10_000
    rows = json.loads(src.read_text())["decode"]
    batches = {r["B"] for r in rows}
    seq = {r["B"] for r in rows if "speedup_graph_seq" in r}
    assert lines == [2 * len(batches) + len(seq) + 2]  # eager + graph (+ back to back) per B, the 1x and 4.5x lines
