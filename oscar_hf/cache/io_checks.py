"""What loading a saved cache refuses before allocating: other weights, non-finite values, sizes beyond the model's
position limit or the tensors in the file."""
from __future__ import annotations

import hashlib

import torch

from ..config import ModelFingerprint, OscarConfig

STATE_NAME = "cache_state.json"  # the saved cache's JSON and tensors (oscar_hf.cache.io says what each holds)
TENSORS_NAME = "cache_tensors.safetensors"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

def weights_digest(model, per_tensor: int = 16) -> str:
    """A short digest of ``model``'s weights: ``per_tensor`` evenly spaced elements of every parameter, rounded to
    bfloat16 (float32 and bfloat16 loads agree), hashed; meta-device parameters are left out."""
    parts = []
    for p in model.parameters():
        x = p.detach()
        x = x.to_local() if hasattr(x, "to_local") else x  # a tensor-parallel shard: this rank's part
        if x.device.type == "meta" or x.numel() == 0:
            continue
        flat = x.reshape(-1)
        k = min(per_tensor, flat.numel())  # evenly spaced, in integers (float32 linspace rounds past the end)
        idx = torch.arange(k, device=flat.device) * (flat.numel() - 1) // max(k - 1, 1)
        sample = flat[idx]
        parts.append((sample.to(torch.bfloat16) if sample.is_floating_point() else sample).float().cpu())
    data = torch.cat(parts) if parts else torch.zeros(0)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]


def check_weights(doc: dict, model, path) -> None:
    """Refuse a cache saved from other weights than ``model``'s (same shapes: a fine-tune, another checkpoint)."""
    saved = doc.get("weights")
    if saved is None:  # saved before the digest was recorded, or from a cache built from a config: not checkable
        return
    if not isinstance(saved, str):
        raise ValueError(f"{path / STATE_NAME}: corrupted weights digest {saved!r}")
    here = weights_digest(model)
    if here != saved:
        theirs, ours = (fp.name_or_path or fp.architecture for fp in (ModelFingerprint.from_dict(doc["fingerprint"]),
                                                                       ModelFingerprint.from_config(model.config)))
        raise ValueError(f"{path}: this cache was saved from other weights than the model it is loaded into: saved "
                         f"from {theirs!r} (weights {saved}), loading into {ours!r} (weights {here}); its keys and "
                         "values only continue the model that wrote them")


def check_finite(tensors: dict, path) -> None:
    """Refuse NaN / inf in any floating-point tensor of a saved cache (they would decode as garbage or zeros)."""
    for key, x in tensors.items():
        if x.is_floating_point() and not bool(torch.isfinite(x).all()):
            bad = int((~torch.isfinite(x)).sum())
            raise ValueError(f"{path / TENSORS_NAME}: tensor {key} holds {bad} non-finite values (NaN / inf) of "
                             f"{x.numel()}: the saved cache is corrupted")


def position_limit(model_config) -> int | None:
    """``max_position_embeddings`` times the largest RoPE scaling ``factor``; None when the config names no limit."""
    cfg = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config
    n = getattr(cfg, "max_position_embeddings", None)
    if not isinstance(n, int) or n <= 0:
        return None
    factors, todo = [1.0], [getattr(cfg, "rope_parameters", None), getattr(cfg, "rope_scaling", None)]
    while todo:  # a dict, or one per layer type (Gemma 3)
        d = todo.pop()
        if isinstance(d, dict):
            f = d.get("factor")
            if isinstance(f, (int, float)) and not isinstance(f, bool):
                factors.append(float(f))
            todo.extend(v for v in d.values() if isinstance(v, dict))
    return int(n * max(factors))


def _bounded(value, name: str, where: str, limit: int | None, lo: int = 0) -> int:
    """``value`` read from the JSON as an integer in ``[lo, limit]``, else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{where}: {name}={value!r} is not an integer >= {lo}")
    if limit is not None and value > limit:
        raise ValueError(f"{where}: {name}={value} exceeds the model's position limit {limit} "
                         "(max_position_embeddings times its RoPE scaling factor)")
    return value


def check_sizes(doc: dict, tensors: dict, config: OscarConfig, limit: int | None, path) -> None:
    """Every size in the JSON bounded by the position limit and, for quantized layers, by the tensors in the file."""
    where = str(path / STATE_NAME)
    _bounded(config.recent, "config.recent", where, limit, lo=1)
    _bounded(config.sink, "config.sink", where, limit)
    if not isinstance(doc.get("layers"), list):
        raise ValueError(f"{where}: no list of layers")
    for i, entry in enumerate(doc["layers"]):
        at = f"{where}, layer {i}"
        if not isinstance(entry, dict) or entry.get("kind") not in ("oscar", "dynamic", "sliding"):
            raise ValueError(f"{at}: not a saved layer ({str(entry)[:80]})")
        if entry.get("empty"):
            continue
        if entry["kind"] == "sliding":
            _bounded(entry.get("cumulative_length"), "cumulative_length", at, limit)
        if entry["kind"] != "oscar":
            continue
        seq, ts, bs0 = (_bounded(entry.get(k), k, at, limit) for k in ("seq_len", "tail_start", "buf_slot0"))
        for k in ("batch_size", "num_kv_heads", "head_dim"):
            _bounded(entry.get(k), k, at, None, lo=1)
        if entry.get("dtype") not in _DTYPES:
            raise ValueError(f"{at}: unknown dtype {entry.get('dtype')!r}")
        p = f"layers.{i}."
        for key in ("pad", "tail_k", "hist_k_codes"):
            if p + key not in tensors:
                raise ValueError(f"saved cache is missing tensor {p + key}")
        pad, tail, hist = tensors[p + "pad"], tensors[p + "tail_k"], tensors[p + "hist_k_codes"]
        if pad.dim() != 1 or entry["batch_size"] != pad.shape[0]:
            raise ValueError(f"{at}: batch_size={entry['batch_size']}, tensor {p}pad holds {tuple(pad.shape)}")
        if tail.dim() != 4 or seq - bs0 != tail.shape[2]:
            raise ValueError(f"{at}: seq_len={seq} buf_slot0={bs0} say {seq - bs0} window slots, tensor {p}tail_k "
                             f"has shape {tuple(tail.shape)}")
        if hist.dim() != 4 or max(0, ts - config.sink) != hist.shape[2]:
            raise ValueError(f"{at}: tail_start={ts} says {max(0, ts - config.sink)} history rows, tensor "
                             f"{p}hist_k_codes has shape {tuple(hist.shape)}")
