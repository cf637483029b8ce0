"""Save a live :class:`~oscar_hf.OscarCache` and load it back to continue generation exactly. The saved folder
(``cache_state.json``, ``cache_tensors.safetensors``, ``rotations/``) and what loading refuses, before allocating and
unpickling nothing: docs/usage.md, "The cache in `generate`"."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from transformers.cache_utils import (DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin,
                                      StaticSlidingWindowLayer)

try:  # Transformers >= 5.2x: the layer of KV sharing's reuse layers (and MoE / MLP-only layers); 5.17 leaves them out
    from transformers.cache_utils import DummyLayer
except ImportError:  # pragma: no cover - transformers 5.17
    DummyLayer = None

from ..config import META_DTYPES, ModelFingerprint, OscarConfig, renamed_keywords
from ..quant import rows_from
from ..rotations import OscarRotations
from . import heads
from .layer import GrowingLayer, OscarLayer, capacity_for

FORMAT = "oscar_hf.cache"
VERSION = 1
STATE_NAME = "cache_state.json"  # the saved cache's JSON and tensors
TENSORS_NAME = "cache_tensors.safetensors"


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
    if (here := weights_digest(model)) != saved:
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


def check_sizes(doc: dict, tensors: dict, config: OscarConfig, limit: int | None, path) -> int:
    """Every size in the JSON bounded by the position limit and, for quantized layers, by the tensors in the file;
    returns the slots the saved cache holds (left padding included): what a fixed capacity must fit."""
    where = str(path / STATE_NAME)
    _bounded(config.recent, "config.recent", where, limit, lo=1)
    _bounded(config.sink, "config.sink", where, limit)
    if not isinstance(doc.get("layers"), list):
        raise ValueError(f"{where}: no list of layers")
    need = 0
    for i, entry in enumerate(doc["layers"]):
        at = f"{where}, layer {i}"
        if not isinstance(entry, dict) or entry.get("kind") not in ("oscar", "dynamic", "sliding"):
            raise ValueError(f"{at}: not a saved layer ({str(entry)[:80]})")
        if entry.get("empty"):
            continue
        keys = tensors.get(f"layers.{i}.keys")  # [B, H, T, D] of a full-precision layer
        if entry["kind"] == "sliding":
            need = max(need, _bounded(entry.get("cumulative_length"), "cumulative_length", at, limit))
        elif entry["kind"] == "dynamic" and keys is not None and keys.dim() == 4:
            need = max(need, keys.shape[2])
        if entry["kind"] != "oscar":
            continue
        seq, ts, bs0 = (_bounded(entry.get(k), k, at, limit) for k in ("seq_len", "tail_start", "buf_slot0"))
        need = max(need, seq)
        for k in ("batch_size", "num_kv_heads", "head_dim"):
            _bounded(entry.get(k), k, at, None, lo=1)
        if entry.get("dtype") not in META_DTYPES:
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
    return need


def save_cache(cache, directory: str | os.PathLike) -> None:
    """Write the live ``cache`` (an ``OscarCache``: ``cache.save(directory)``) to ``directory`` (layout in the module
    docstring); NotImplementedError for a cache holding an SSM / conv state."""
    from safetensors.torch import save_file
    path = Path(directory)
    tensors, layers = {}, []
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionCacheLayerMixin):  # hybrid OSCAR layers too: their state would be lost
            raise NotImplementedError(f"cannot save cache layer {i}: {type(layer).__name__} holds a linear-attention"
                                      " / SSM / convolution state (Transformers' LinearAttentionLayer), which "
                                      "OscarCache.save does not serialize")
        if isinstance(layer, OscarLayer):
            if layer.pending:
                raise RuntimeError("cannot save an OscarCache in the middle of a forward pass")
            if not layer.is_initialized:
                layers.append(dict(kind="oscar", empty=True))
                continue
            st = layer.export_state()
            t = {k: st[k] for k in ("pad", "sink_k", "sink_v", "tail_k", "tail_v")}
            for kv in ("k", "v"):
                rows = st[f"hist_{kv}"]  # (3-bit keys: hist_k_hi too)
                t.update({f"hist_{kv}_{f}": x for f, x in zip(type(rows)._fields, rows)})
                if layer.retrieval_heads:  # retrieval heads: every slot [0, seq_len), in their stored form
                    t.update(zip(_fp_names(kv, cache.oscar_config.retrieval_bits), st[f"fp_{kv}"]))
            if st["mu_k_seq"] is not None:  # key_offset="prefill": the history is centered on it
                t["mu_k_seq"] = st["mu_k_seq"]
            tensors.update({f"layers.{i}.{k}": v.detach().cpu().contiguous() for k, v in t.items()})
            layers.append(dict(kind="oscar", empty=False, seq_len=st["seq_len"], tail_start=st["tail_start"],
                               buf_slot0=st["tail_start"], dtype=str(layer.dtype).removeprefix("torch."),
                               batch_size=layer.batch_size, num_kv_heads=layer.num_kv_heads, head_dim=layer.head_dim))
        else:
            entry, kv = _full_precision_entry(i, layer)
            if kv is not None:
                tensors[f"layers.{i}.keys"], tensors[f"layers.{i}.values"] = (x.detach().cpu().contiguous() for x in kv)
            layers.append(entry)
    path.mkdir(parents=True, exist_ok=True)  # after every layer was read: a refused cache writes nothing
    save_file(tensors, str(path / TENSORS_NAME), metadata={"format": FORMAT})
    cache.rotations.save_pretrained(path / "rotations")
    model = cache._model_ref() if getattr(cache, "_model_ref", None) is not None else None
    doc = dict(format=FORMAT, version=VERSION, config=cache.oscar_config.to_dict(),
               fingerprint=cache.fingerprint.to_dict(), weights=weights_digest(model) if model is not None else None,
               max_cache_len=cache.max_cache_len_fixed, layers=layers)
    (path / STATE_NAME).write_text(json.dumps(doc, indent=2))


def _full_precision_entry(i: int, layer) -> tuple[dict, tuple | None]:
    """A full-precision layer's saved entry and ``(keys, values)`` ``[B, H, T, D]`` (None when empty), in the eager
    form: a compiled storage's layers are saved as the DynamicLayer / DynamicSlidingWindowLayer holding their tokens."""
    if isinstance(layer, StaticSlidingWindowLayer):
        # its W slots hold the last min(T, W) tokens in order; DynamicSlidingWindowLayer's the last min(T, W - 1)
        w, t = layer.max_cache_len, layer.cumulative_length_int
        keep = slice(1, None) if t >= w else slice(0, t)
        kv = (layer.keys[:, :, keep], layer.values[:, :, keep]) if layer.is_initialized and t else None
        return dict(kind="sliding", empty=kv is None, sliding_window=w, cumulative_length=t if kv is not None else 0), kv
    if isinstance(layer, GrowingLayer):  # loads back through GrowingLayer.update / DynamicLayer.update
        kv = layer.used() if layer.is_initialized and layer.host_len else None
        return dict(kind="dynamic", empty=kv is None), kv
    if DummyLayer is not None and isinstance(layer, DummyLayer):  # caches nothing: load leaves it as it is
        return dict(kind="dynamic", empty=True), None
    if isinstance(layer, DynamicLayer):
        sliding = isinstance(layer, DynamicSlidingWindowLayer)
        kv = None if not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0 else (layer.keys, layer.values)
        entry = dict(kind="sliding" if sliding else "dynamic", empty=kv is None)
        if sliding:
            entry.update(sliding_window=layer.sliding_window, cumulative_length=layer.cumulative_length)
        return entry, kv
    # e.g. a linear-attention / conv layer's recurrent state (Transformers' LinearAttentionLayer)
    raise NotImplementedError(f"cannot save cache layer {i}: {type(layer).__name__} is not serialized by "
                              "OscarCache.save (a state layer of a hybrid model)")


def _fp_names(kv: str, bits: int) -> list[str]:
    """Saved names of the retrieval heads' tensors: ``fp_k``, or ``fp_k_codes/scale/zero`` at 8 or 4 bits."""
    return [f"fp_{kv}"] if bits == 16 else [f"fp_{kv}_{name}" for name in heads.part_names(bits)]


def _fixed_capacity(doc: dict, need: int, max_cache_len: int | None, limit: int | None) -> int:
    """A StaticOscarCache's capacity for the saved state of ``need`` slots (:func:`check_sizes`): ``max_cache_len``,
    else the saved one (at most ``limit``), else ``need`` plus headroom."""
    if max_cache_len is None:
        saved = doc.get("max_cache_len")  # absent in caches saved before it was recorded
        if saved is not None:
            saved = _bounded(saved, "max_cache_len", f"{STATE_NAME} (pass max_cache_len= to choose the capacity)",
                             limit)
        return saved if saved is not None and saved >= need else capacity_for(need)
    if int(max_cache_len) < need:
        raise ValueError(f"max_cache_len={max_cache_len} is smaller than the saved cache, which holds {need} tokens "
                         "(left padding included)")
    return int(max_cache_len)


def _fill_fixed_window(layer: StaticSlidingWindowLayer, keys: torch.Tensor, values: torch.Tensor, cumulative: int):
    """Load a saved ``DynamicSlidingWindowLayer`` (the last ``min(cumulative, window - 1)`` tokens) into a
    ``StaticSlidingWindowLayer``'s slots, in order (its last ``window - 1`` once full)."""
    window = layer.max_cache_len
    layer.lazy_initialization(keys, values)
    if cumulative >= window:
        n = window - 1
        if keys.shape[2] < n:
            raise ValueError(f"saved sliding window holds {keys.shape[2]} tokens, {n} needed")
        layer.keys[:, :, 1:], layer.values[:, :, 1:] = keys[:, :, -n:], values[:, :, -n:]
    else:
        if keys.shape[2] != cumulative:
            raise ValueError(f"saved sliding window holds {keys.shape[2]} tokens, {cumulative} expected")
        layer.keys[:, :, :cumulative], layer.values[:, :, :cumulative] = keys, values
        layer.cumulative_length.fill_(cumulative)
    layer.cumulative_length_int = cumulative


def load_cache(cls, directory: str | os.PathLike, model, device=None, compile="auto", *, fixed_capacity: bool = False,
               max_cache_len: int | None = None):
    """A ``cls`` for ``model`` holding the state saved in ``directory``, on ``device`` (default: the model's).
    ``fixed_capacity``: ``cls`` is a StaticOscarCache of ``max_cache_len`` slots."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    path = Path(directory)
    if not (path / STATE_NAME).is_file() or not (path / TENSORS_NAME).is_file():
        raise OSError(f"{path} is not a saved OscarCache (needs {STATE_NAME} and {TENSORS_NAME})")
    try:
        doc = json.loads((path / STATE_NAME).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path / STATE_NAME}: corrupted JSON ({e})") from None
    if doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise ValueError(f"{path}: not an oscar_hf cache of version {VERSION}")
    try:
        tensors = load_file(str(path / TENSORS_NAME))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"{path / TENSORS_NAME}: corrupted or truncated ({e})") from None
    # (old field names load as they were; saved before retrieval_bits existed: 16 bits)
    config = OscarConfig.from_dict({"retrieval_bits": 16, **renamed_keywords(doc["config"], "saved cache", warn=False)})
    saved_fp = ModelFingerprint.from_dict(doc["fingerprint"])
    if problems := saved_fp.mismatches(ModelFingerprint.from_config(model.config)):
        raise ValueError("saved cache was made for another model: " + "; ".join(problems))
    check_weights(doc, model, path)
    check_finite(tensors, path)
    limit = position_limit(model.config)
    need = check_sizes(doc, tensors, config, limit, path)
    rot = OscarRotations.from_pretrained(path / "rotations")
    fixed = dict(max_cache_len=_fixed_capacity(doc, need, max_cache_len, limit)) if fixed_capacity else {}
    cache = cls(model, rot, config, compile=compile, **fixed)
    device = next(model.parameters()).device if device is None else device
    if len(doc["layers"]) != len(cache.layers):
        raise ValueError(f"saved cache has {len(doc['layers'])} layers, model has {len(cache.layers)}")
    meta = config.torch_meta_dtype
    for i, (entry, layer) in enumerate(zip(doc["layers"], cache.layers)):
        if entry.get("empty"):
            continue
        if entry["kind"] == "oscar":
            if not isinstance(layer, OscarLayer):
                raise ValueError(f"layer {i}: saved as quantized, but this cache does not quantize it")
            b, hk, d = entry["batch_size"], entry["num_kv_heads"], entry["head_dim"]
            dtype = META_DTYPES[entry["dtype"]]
            s0, g = config.sink, config.group_size
            seq, ts, bs0 = entry["seq_len"], entry["tail_start"], entry["buf_slot0"]
            if not 0 <= bs0 <= ts <= seq:
                raise ValueError(f"layer {i}: inconsistent positions {bs0=} {ts=} {seq=}")
            n = max(0, ts - s0)
            p = f"layers.{i}."

            def take(key, shape, dt):  # a saved tensor of this layer, checked, on the device
                key = p + key
                if key not in tensors:
                    raise ValueError(f"saved cache is missing tensor {key}")
                x = tensors.pop(key)
                if tuple(x.shape) != tuple(shape) or x.dtype != dt:
                    raise ValueError(f"saved cache tensor {key}: expected {dt} {tuple(shape)}, got {x.dtype} "
                                     f"{tuple(x.shape)}")
                return x.to(device)

            hq, n_fp = hk - len(layer.retrieval_heads), len(layer.retrieval_heads)  # quantized / retrieval heads
            st = dict(seq_len=seq, tail_start=ts, buf_slot0=bs0, pad=take("pad", (b,), torch.long), fp_k=None,
                      fp_v=None, mu_k_seq=None)
            for kv in ("k", "v"):
                st[f"sink_{kv}"] = take(f"sink_{kv}", (b, hk, s0, d), dtype)
                st[f"tail_{kv}"] = take(f"tail_{kv}", (b, hk, seq - bs0, d), dtype)
                gk = g if kv == "k" else config.value_group(d)  # (the values' group may be their own)
                scale, zero = (take(f"hist_{kv}_{f}", (b, hq, n, d // gk), meta) for f in ("scale", "zero"))
                # (a saved hist_k_hi that this config does not read: "unexpected tensors" below)
                hi = (take("hist_k_hi", (b, hq, n, d // 8), torch.uint8),) if kv == "k" and config.key_bits == 3 else ()
                st[f"hist_{kv}"] = rows_from((take(f"hist_{kv}_codes", (b, hq, n, d // 4), torch.uint8), scale, zero,
                                              *hi))
                if n_fp:  # the retrieval heads: every slot [0, seq) in their stored form
                    specs = zip(_fp_names(kv, config.retrieval_bits), heads.part_specs(config.retrieval_bits, d, dtype))
                    st[f"fp_{kv}"] = tuple(take(name, (b, n_fp, seq, last), dt) for name, (last, dt) in specs)
            if config.key_offset == "prefill" and n > 0:
                st["mu_k_seq"] = take("mu_k_seq", (b, hq, d), torch.float32)
            elif p + "mu_k_seq" in tensors:
                raise ValueError(f"layer {i}: the saved history is centered on per-sequence key means "
                                 "(key_offset='prefill'), this cache's config says key_offset='calibrated'")
            layer.import_state(st)
        else:
            keys, values = tensors.pop(f"layers.{i}.keys", None), tensors.pop(f"layers.{i}.values", None)
            # (keys and values may differ in width: an MLA latent [B, 1, S, kv_lora_rank] and its rope part)
            if keys is None or values is None or keys.dim() != 4 or keys.shape[:3] != values.shape[:3]:
                raise ValueError(f"layer {i}: missing or malformed full-precision keys/values")
            if isinstance(layer, StaticSlidingWindowLayer):
                _fill_fixed_window(layer, keys.to(device), values.to(device), int(entry["cumulative_length"]))
                continue
            layer.update(keys.to(device), values.to(device))
            if entry["kind"] == "sliding":
                layer.cumulative_length = int(entry["cumulative_length"])
    if tensors:
        raise ValueError(f"saved cache has unexpected tensors {sorted(tensors)[:5]}")
    return cache
