"""The interface of a KV-cache method in the comparison (:class:`KVMethod`) and how every row counts its bits: codes +
metadata of the quantized tokens + :data:`FP_BITS` for every token kept in full precision."""
from __future__ import annotations

from .fakequant import FakeQuantSpec

FP_BITS = 16  # full-precision tokens are counted as BF16 (the deployed dtype), whatever the eval dtype


def window_counts(T: int, sink: int, recent: int) -> tuple[int, int]:
    """(full-precision tokens, quantized tokens) of a sink/recent cache after T tokens."""
    if T - recent > sink:
        return sink + recent, T - sink - recent
    return T, 0


def mix_bits(n_fp: int, n_q: int, q_bits: float) -> float:
    return (n_fp * FP_BITS + n_q * q_bits) / max(n_fp + n_q, 1)


class KVMethod:
    """Base class of a row in the comparison."""

    name = "base"
    fast = True  # has a teacher-forced fake-quant equivalent

    def fake_spec(self, model) -> FakeQuantSpec | None:
        raise NotImplementedError(f"{self.name} has no fake-quant equivalent; score it token by token")

    def make_cache(self, model):
        raise NotImplementedError(f"{self.name} has no real cache implementation")

    def bits(self, T: int, head_dim: int, prefill_len: int = 1) -> float:
        raise NotImplementedError

    def settings(self) -> dict:
        return {k: v for k, v in vars(self).items() if not k.startswith("_") and isinstance(v, (int, float, str, bool))}
