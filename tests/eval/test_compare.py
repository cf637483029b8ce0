"""Comparison report: the windows sweep pivot takes the right reference and the main table's (64, 256) cell."""
import math

from oscar_hf.eval.attention_fidelity import summary_table
from oscar_hf.eval.compare import markdown, windows_pivot


def row(table, label, ppl, window_ppl, n_windows, bits=4.61):
    return dict(table=table, label=label, ppl=ppl, window_ppl=window_ppl, n_windows=n_windows, context_len=2048,
                prefill_len=1, tokens=2047 * n_windows, bits=bits, mean_bits=8.0, path="fast")


def test_windows_pivot_uses_same_window_reference():
    res = [
        row("main", "FP32 KV (DynamicCache)", math.sqrt(20 * 10), [20.0, 10.0], 2, 16),
        row("main", "OSCAR + centering", math.sqrt(22 * 11), [22.0, 11.0], 2),
        row("windows", "OSCAR + centering, sink 0, recent 64", 30.0, [30.0], 1, 2.9),
        row("windows", "Hadamard, sink 0, recent 64", 40.0, [40.0], 1, 2.9),
        dict(table="windows", label="Hadamard, sink 16, recent 128", error="RuntimeError: x"),
    ]
    pv = windows_pivot(res)
    lines = {ln.split("|")[1].strip(): ln for ln in pv.splitlines() if ln.startswith("| ")}
    # reference = FP32's first window (20), not the 2-window geometric mean
    assert "+50.0% (30.00)" in lines["OSCAR + centering"]
    assert "+10.0% (22.00)" in lines["OSCAR + centering"]  # (64, 256) = main row, first window
    assert "+100.0% (40.00)" in lines["Hadamard"] and "—" in lines["Hadamard"]
    md = markdown(res, "cmd")
    assert "failed: RuntimeError: x" in md and "Command: `cmd`" in md


def test_attention_summary_table_means_over_layers():
    t = summary_table({"m": {512: {"kl": [0.1, 0.3], "rel_err": [0.5, 0.7]}}})
    assert "| m | 0.2000 | 0.600 |" in t
