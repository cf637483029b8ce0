"""benchmarks/soak.py's serving part in its tiny CPU mode: requests with cancellations and model switches through
``oscar_serving`` leave nothing behind, and the checks fire on a store that keeps its windows."""
import pytest
from script_utils import import_benchmark, run_tiny


@pytest.fixture(scope="module")
def soak():
    return import_benchmark("soak")


def test_tiny_serving_soak_passes(soak, tmp_path):
    rc, res = run_tiny(soak, tmp_path, "--parts", "serving")
    assert rc == 0 and res["ok"], {k: c for k, c in res["checks"].items() if not c["ok"]}
    rounds = res["serving"]["rounds"]
    assert [r["model"] for r in rounds] == list("ABABAB")  # a model switch every round
    assert sum(r["requests"] for r in rounds) == 120
    assert all(r["cancelled"] >= 4 and r["finished"] + r["cancelled"] == r["requests"] for r in rounds)
    assert all(r["store_released"] and not any(r["held_after_stop"].values()) for r in rounds)


def test_serving_soak_sees_a_store_that_keeps_its_windows(soak, tmp_path, monkeypatch):
    """A store whose window memory is never given back (``release_memory`` a no-op) fails the soak."""
    from oscar_hf.serving.store import WindowPool

    monkeypatch.setattr(WindowPool, "release_memory", lambda self: None)
    rc, res = run_tiny(soak, tmp_path, "--parts", "serving", "--requests", "40", "--rounds", "2")
    assert rc == 1 and not res["checks"]["serving.nothing_held_after_stop"]["ok"]
