"""The kernels' plain-Python host helpers (``oscar_hf.kernels``) agree with Triton's own."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

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
    from oscar_hf.kernels.decode_triton import _pow2_below_within

    r = _pow2_below_within(s, slack)
    p = next_pow2(s + 1) // 2 if s else 0  # the largest power of two <= s
    assert r in (s, p)
    assert r == s or (p < s and s - p <= slack * s)
    assert (r == p) or s == p or s - p > slack * s


def test_times_buf_checked():
    """The diagnostic timestamp buffer: a shape that would let the stamps run past its end (too few rows for the
    prologue's, history programs reaching the prologue's rows, the wrong width) or a buffer not on CUDA / not int64 is
    a clear error before any launch."""
    import torch

    from oscar_hf.kernels.decode_triton import COMBINE_TIME_ROW, PROLOGUE_TIME_ROW, _check_times_buf

    row0, row1 = PROLOGUE_TIME_ROW.value, COMBINE_TIME_ROW.value
    for shape, hist, pro, comb in (((row0 + 71, 8), 1024, 72, 0), ((1 << 16, 8), row0 + 1, 0, 0),
                                   ((1 << 16, 7), 1024, 72, 0), ((8 * (1 << 16),), 1024, 72, 0),
                                   ((row1 + 127, 8), 1024, 72, 128),  # the combine's stamps past the end
                                   ((1 << 16, 8), 1024, row1 - row0 + 1, 0)):  # the prologue's into the combine's
        with pytest.raises(ValueError, match="needs"):
            _check_times_buf(torch.zeros(shape, dtype=torch.int64), 8, hist, pro, comb)
    with pytest.raises(ValueError, match="CUDA"):  # the shape fits (the check gets as far as the device)
        _check_times_buf(torch.zeros(row1 + 128, 8, dtype=torch.int64), 8, 1024, 72, 128)
    with pytest.raises(ValueError, match="CUDA"):  # the right shape, but on the CPU
        _check_times_buf(torch.zeros(row0 + 72, 8, dtype=torch.int64), 8, 1024, 72)
    with pytest.raises(ValueError, match="int64"):
        _check_times_buf(torch.zeros(row0 + 72, 8, dtype=torch.int32), 8, 1024, 72)


ROOT = Path(__file__).resolve().parents[2]


def _script(name: str):
    """``scripts/<name>.py`` loaded as a module (the scripts are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"{name}_for_test", ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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


@pytest.mark.parametrize("name", ["kernels_h100_session26i.json", "kernels_h200_session24m.json"])
def test_bench_kernels_plot(tmp_path, monkeypatch, name):
    """The kernel benchmark's plot (``scripts/bench_kernels.py --plot``, on any machine) from a committed result, with
    the back-to-back graph timing (session 26 on) and without it (before): the PNG is written beside the JSON and has
    one speedup line more per batch size where the result holds that timing."""
    import json
    import shutil

    src = ROOT / "benchmarks" / "results" / name
    shutil.copy(src, tmp_path / name)
    bk = _script("bench_kernels")
    lines = _spy_savefig(monkeypatch, lambda fig: len(fig.axes[0].get_lines()))
    bk.plot(str(tmp_path / name))
    png = tmp_path / name.replace(".json", "_speedup.png")
    assert png.stat().st_size > 10_000
    rows = json.loads(src.read_text())["decode"]
    batches = {r["B"] for r in rows}
    seq = {r["B"] for r in rows if "speedup_graph_seq" in r}
    assert lines == [2 * len(batches) + len(seq) + 2]  # eager + graph (+ back to back) per B, the 1x and 4.5x lines


def test_timeline_plot_rows(tmp_path, monkeypatch):
    """The per-program timeline's plot (``scripts/timeline_hist_programs.py --plot PATH[:ROW] ...``, on any machine)
    from committed results: each panel shows the row asked for (its config in the title, its stamps as bars), the
    first row without ``:ROW``; a row the result does not hold is an error that names the file."""
    import json

    src = ROOT / "benchmarks" / "results" / "timeline_hist_h100_session27e.json"
    tl = _script("timeline_hist_programs")
    figs = _spy_savefig(monkeypatch, lambda fig: [(ax.get_title(), [p.get_x() for p in ax.patches]) for ax in fig.axes])
    out = tmp_path / "timeline.png"
    tl.plot([str(src), f"{src}:3"], str(out))
    assert out.stat().st_size > 10_000
    rows = [r for r in json.loads(src.read_text())["rows"] if "programs" in r]
    assert len(figs) == 1 and len(figs[0]) == 2
    panels = figs[0]
    for (title, lefts), row in zip(panels, (rows[0], rows[3])):
        assert json.dumps(row["config"]) in title and f"graph {row['graph_us']:.1f} us" in title
        # one bar per stamp, from its p10
        assert lefts == pytest.approx([row["programs"][f"{s}_us"]["p10"] for s in tl.SLOTS])
    assert rows[0]["config"] != rows[3]["config"]
    with pytest.raises(IndexError, match="timeline_hist_h100_session27e.json: row 9"):
        tl.plot([f"{src}:9"], str(out))
