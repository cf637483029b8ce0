"""benchmarks/soak.py in its tiny CPU mode: the checks pass on the real cache and fire on broken ones."""
import pytest
import torch
from script_utils import import_benchmark, run_tiny


@pytest.fixture(scope="module")
def soak():
    return import_benchmark("soak")


def test_tiny_soak_passes(soak, tmp_path):
    rc, res = run_tiny(soak, tmp_path)
    assert rc == 0 and res["ok"], {k: c for k, c in res["checks"].items() if not c["ok"]}
    long, calls = res["long"], res["calls"]
    assert long["new_tokens"] == 160 and long["nonfinite_scores"] == 0
    assert long["memory_report_final"]["history_codes"] > 0  # the INT2 history was exercised
    assert len(long["samples"]) >= 5 and long["samples"][-1]["seq_len"] == 48 + 160 - 1
    assert res["checks"]["long.cache_linear"]["ok"]
    assert calls["calls"] == 8 and not calls["mismatches"]["greedy"] and not calls["mismatches"]["sample"]
    assert set(calls["reference_tokens"]) == {"greedy", "sample"}
    assert [r["reuse"] for r in calls["records"][:4]] == [True, False, True, False]
    assert [r["kind"] for r in calls["records"][:4]] == ["greedy", "greedy", "sample", "sample"]
    assert res["checks"]["calls.live_tensors_flat"]["ok"]


def test_nan_in_the_cache_is_caught(soak, tmp_path):
    rc, res = run_tiny(soak, tmp_path, "--parts", "long", "--inject-nan-at", "100")
    assert rc == 1 and not res["ok"]
    assert not res["checks"]["long.finite_scores"]["ok"] and not res["checks"]["long.finite_cache"]["ok"]
    assert res["checks"]["long.tokens"]["ok"]


def test_a_leak_is_caught(soak, tmp_path, monkeypatch):
    leaked = []

    class LeakyCache(soak.OscarCache):
        """Keeps one tensor alive per cache built (what a registry of caches that is never cleaned would do)."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            leaked.append(torch.zeros(4))

    monkeypatch.setattr(soak, "OscarCache", LeakyCache)
    # (enough calls that the leak keeps growing through the second half of the counts)
    rc, res = run_tiny(soak, tmp_path, "--parts", "calls", "--calls", "20")
    assert rc == 1
    failed = {k for k, c in res["checks"].items() if not c["ok"]}
    assert failed == {"calls.live_tensors_flat"}, failed


def test_a_reset_that_keeps_state_is_caught(soak, tmp_path, monkeypatch):
    class StaleCache(soak.OscarCache):
        def reset(self):
            pass

    monkeypatch.setattr(soak, "OscarCache", StaleCache)
    rc, res = run_tiny(soak, tmp_path, "--parts", "calls")
    assert rc == 1
    failed = {k for k, c in res["checks"].items() if not c["ok"]}
    assert "calls.all_calls_ran" in failed and ("calls.no_exception" in failed or any(k.startswith("calls.reset_") for k in failed))


def _records(soak, peak_mib):
    """Post-warm-up records of the calls part's cycle (reset / fresh cache x greedy / sampled), peaks in MiB."""
    return [dict(i=i, reuse=i % 2 == 0, kind="sample" if (i // 2) % 2 else "greedy",
                 peak=round(peak_mib(i, i % 2 == 0) * soak.MiB)) for i in range(8, 200)]


def test_peaks_are_compared_within_one_kind_of_call(soak):
    """Fresh-cache calls peak one cache above reset-cache calls (H200: 385.0 vs 360.3 MiB, flat over 200 calls): the
    check passes and reports each kind's peaks; one kind growing by more than the tolerance fails it."""
    checks = {}
    by_kind = soak.check_peaks_flat(checks, _records(soak, lambda i, reuse: 360.3 if reuse else 385.0), 4.0)
    assert checks["calls.peak_flat"]["ok"], checks
    assert checks["calls.peak_flat"]["peaks_by_kind"] == by_kind
    assert set(by_kind) == {"reset_greedy", "fresh_greedy", "reset_sample", "fresh_sample"}
    assert by_kind["fresh_greedy"]["max_mib"] == pytest.approx(385.0)
    assert by_kind["reset_sample"]["first_mib"] == pytest.approx(360.3)
    assert checks["calls.peak_flat"]["growth_mib"] == 0
    checks = {}
    by_kind = soak.check_peaks_flat(checks, _records(soak, lambda i, reuse: 360.3 if reuse else 385.0 + i / 20), 4.0)
    assert not checks["calls.peak_flat"]["ok"]
    assert checks["calls.peak_flat"]["growth_mib"] == pytest.approx((197 - 9) / 20)  # fresh greedy: calls 9 ... 197
    assert by_kind["reset_greedy"]["growth_mib"] == by_kind["reset_sample"]["growth_mib"] == 0


def test_late_growth_tells_a_leak_from_a_step_and_an_alternation(soak):
    assert soak.late_growth([2363, 2957, 2957, 2957, 2957, 2957]) == 0  # built once early on
    assert soak.late_growth([281, 313, 281, 313, 313, 281]) == 0  # an allocator block on some calls
    assert soak.late_growth([10, 11, 12, 13, 14, 15]) == 3  # one more each count: a leak
    assert soak.late_growth([5]) == 0
