"""Save a live :class:`~oscar_hf.OscarCache` and load it back to continue generation exactly. A saved cache:

* ``cache_state.json``: format, config, fingerprint, ``weights`` (:func:`weights_digest`, null from a config),
  ``max_cache_len`` (null when growable), per layer its kind and positions (``seq_len``, ``tail_start``, ...);
* ``cache_tensors.safetensors``: per layer the *used* part of each buffer in the eager layer's layout;
* ``rotations/``: the artifact the cache was built with.

Loading checks everything before allocating (:mod:`.io_checks`) and unpickles nothing.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticSlidingWindowLayer

from ..config import ModelFingerprint, OscarConfig
from ..config_checks import renamed_keywords
from ..quant import QuantizedRows
from ..rotations import OscarRotations
from . import heads
from .io_checks import (  # noqa: F401  (weights_digest, position_limit: part of this module's API)
    _DTYPES, STATE_NAME, TENSORS_NAME, _bounded, check_finite, check_sizes, check_weights, position_limit,
    weights_digest)
from .compiled import CompiledOscarLayer, capacity_for
from .dynamic import CROP_RESERVE, TAIL_SLACK, OscarLayer

FORMAT = "oscar_hf.cache"
VERSION = 1


def save_cache(cache, directory: str | os.PathLike) -> None:
    """Write ``cache`` (an ``OscarCache``) to ``directory`` (layout in the module docstring)."""
    from safetensors.torch import save_file
    path = Path(directory)
    tensors, layers = {}, []
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, (OscarLayer, CompiledOscarLayer)):
            if getattr(layer, "pending", None) is not None:
                raise RuntimeError("cannot save an OscarCache in the middle of a forward pass")
            if not layer.is_initialized or (isinstance(layer, OscarLayer) and layer.pad is None):
                layers.append(dict(kind="oscar", empty=True))
                continue
            st = layer_state(layer)
            t = {k: st[k] for k in ("pad", "sink_k", "sink_v", "tail_k", "tail_v")}
            for kv in ("k", "v"):
                t.update({f"hist_{kv}_{f}": x for f, x in zip(("codes", "scale", "zero"), st[f"hist_{kv}"])})
            if st["mu_k_seq"] is not None:  # key_offset="prefill": the history is centered on it
                t["mu_k_seq"] = st["mu_k_seq"]
            if layer.retrieval_heads:  # retrieval heads: every slot [0, seq_len), in their stored form
                for kv in ("k", "v"):
                    t.update(zip(_fp_names(kv, cache.oscar_config.retrieval_bits), st[f"fp_{kv}"]))
            tensors.update({f"layers.{i}.{k}": v.detach().cpu().contiguous() for k, v in t.items()})
            layers.append(dict(kind="oscar", empty=False, seq_len=st["seq_len"], tail_start=st["tail_start"],
                               buf_slot0=st["tail_start"], dtype=str(layer.dtype).removeprefix("torch."),
                               batch_size=layer.batch_size, num_kv_heads=layer.num_kv_heads, head_dim=layer.head_dim))
        elif isinstance(layer, DynamicLayer):
            kind = "sliding" if isinstance(layer, DynamicSlidingWindowLayer) else "dynamic"
            entry = dict(kind=kind, empty=not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0)
            if kind == "sliding":
                entry.update(sliding_window=layer.sliding_window, cumulative_length=layer.cumulative_length)
            if not entry["empty"]:
                tensors[f"layers.{i}.keys"] = layer.keys.detach().cpu().contiguous()
                tensors[f"layers.{i}.values"] = layer.values.detach().cpu().contiguous()
            layers.append(entry)
        else:  # e.g. a linear-attention / conv layer's recurrent state (Transformers' LinearAttentionLayer)
            raise NotImplementedError(f"cannot save cache layer {i}: {type(layer).__name__} is not serialized by "
                                      "OscarCache.save (a state layer of a hybrid model)")
    path.mkdir(parents=True, exist_ok=True)  # after every layer was read: a refused cache writes nothing
    save_file(tensors, str(path / TENSORS_NAME), metadata={"format": FORMAT})
    cache.rotations.save_pretrained(path / "rotations")
    model = cache._model_ref() if getattr(cache, "_model_ref", None) is not None else None
    doc = dict(format=FORMAT, version=VERSION, config=cache.oscar_config.to_dict(),
               fingerprint=cache.fingerprint.to_dict(), weights=weights_digest(model) if model is not None else None,
               max_cache_len=cache.max_cache_len_fixed, layers=layers)
    (path / STATE_NAME).write_text(json.dumps(doc, indent=2))


def layer_state(layer) -> dict:
    """An OSCAR layer's saved form: positions and the used part of each buffer (the eager layer's layout)."""
    if isinstance(layer, CompiledOscarLayer):
        return layer.export_state()
    # the rollback reserve [buf_slot0, tail_start) is not saved: a loaded cache starts without one
    a, b = layer.tail_start - layer.buf_slot0, layer.seq_len - layer.buf_slot0
    hist_k, hist_v = layer.hist_view()
    st = dict(seq_len=layer.seq_len, tail_start=layer.tail_start, pad=layer.pad, sink_k=layer.sink_k,
              sink_v=layer.sink_v, tail_k=layer.tail_k[:, :, a:b], tail_v=layer.tail_v[:, :, a:b], hist_k=hist_k,
              hist_v=hist_v, mu_k_seq=layer.mu_k_seq)
    if layer.retrieval_heads:
        st["fp_k"], st["fp_v"] = (tuple(x[:, :, : layer.seq_len] for x in store) for store in (layer.fp_k, layer.fp_v))
    return st


def _fp_names(kv: str, bits: int) -> list[str]:
    """Saved names of the retrieval heads' tensors: ``fp_k``, or ``fp_k_codes/scale/zero`` at 8 or 4 bits."""
    return [f"fp_{kv}"] if bits == 16 else [f"fp_{kv}_{name}" for name in heads.part_names(bits)]


def _expect(t: dict, key: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    if key not in t:
        raise ValueError(f"saved cache is missing tensor {key}")
    x = t.pop(key)
    if tuple(x.shape) != tuple(shape) or x.dtype != dtype:
        raise ValueError(f"saved cache tensor {key}: expected {dtype} {tuple(shape)}, got {x.dtype} {tuple(x.shape)}")
    return x


def _saved_length(doc: dict, tensors: dict) -> int:
    """Slots the saved cache holds (left padding included): what a fixed capacity must fit."""
    n = 0
    for i, entry in enumerate(doc["layers"]):
        if entry.get("empty"):
            continue
        if entry["kind"] == "oscar":
            n = max(n, int(entry["seq_len"]))
        elif entry["kind"] == "sliding":
            n = max(n, int(entry["cumulative_length"]))
        elif f"layers.{i}.keys" in tensors and tensors[f"layers.{i}.keys"].dim() == 4:
            n = max(n, tensors[f"layers.{i}.keys"].shape[2])
    return n


def _fixed_capacity(doc: dict, tensors: dict, max_cache_len: int | None, limit: int | None = None) -> int:
    """A StaticOscarCache's capacity for the saved state: ``max_cache_len``, else the saved one (at most ``limit``),
    else the saved length plus headroom."""
    need = _saved_length(doc, tensors)
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


def _sink_from_tail(sink: torch.Tensor, tail: torch.Tensor, pad: torch.Tensor, tail_start: int) -> torch.Tensor:
    """The sink as :class:`CompiledOscarLayer` holds it, from the start: entries the eager layer still keeps in
    its tail (slots ``>= tail_start``) are copied from there."""
    b, hk, s0, d = sink.shape
    n = tail.shape[2]
    if n == 0 or s0 == 0:
        return sink
    slot = pad[:, None] + torch.arange(s0, device=pad.device)[None, :]  # [B, S0]
    in_tail = (slot >= tail_start) & (slot < tail_start + n)
    idx = (slot - tail_start).clamp(0, n - 1)[:, None, :, None].expand(-1, hk, -1, d)
    return torch.where(in_tail[:, None, :, None], tail.gather(2, idx), sink)


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
    saved_config = dict(renamed_keywords(doc["config"], "saved cache", warn=False))
    saved_config.setdefault("retrieval_bits", 16)
    config = OscarConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved_config.items()})
    saved_fp = ModelFingerprint.from_dict(doc["fingerprint"])
    problems = saved_fp.mismatches(ModelFingerprint.from_config(model.config))
    if problems:
        raise ValueError("saved cache was made for another model: " + "; ".join(problems))
    check_weights(doc, model, path)
    check_finite(tensors, path)
    limit = position_limit(model.config)
    check_sizes(doc, tensors, config, limit, path)
    rot = OscarRotations.from_pretrained(path / "rotations")
    if fixed_capacity:
        capacity = _fixed_capacity(doc, tensors, max_cache_len, limit)
        cache = cls(model, rot, config, compile=compile, max_cache_len=capacity)
    else:
        cache = cls(model, rot, config, compile=compile)
    if device is None:
        device = next(model.parameters()).device
    if len(doc["layers"]) != len(cache.layers):
        raise ValueError(f"saved cache has {len(doc['layers'])} layers, model has {len(cache.layers)}")
    meta = config.torch_meta_dtype
    for i, (entry, layer) in enumerate(zip(doc["layers"], cache.layers)):
        if entry.get("empty"):
            continue
        if entry["kind"] == "oscar":
            if not isinstance(layer, (OscarLayer, CompiledOscarLayer)):
                raise ValueError(f"layer {i}: saved as quantized, but this cache does not quantize it")
            b, hk, d = entry["batch_size"], entry["num_kv_heads"], entry["head_dim"]
            dtype = _DTYPES[entry["dtype"]]
            s0, g = config.sink, config.group_size
            seq, ts, bs0 = entry["seq_len"], entry["tail_start"], entry["buf_slot0"]
            if not 0 <= bs0 <= ts <= seq:
                raise ValueError(f"layer {i}: inconsistent positions {bs0=} {ts=} {seq=}")
            n = max(0, ts - s0)
            p = f"layers.{i}."
            pad = _expect(tensors, p + "pad", (b,), torch.long)
            sink = [_expect(tensors, p + k, (b, hk, s0, d), dtype) for k in ("sink_k", "sink_v")]
            tail = [_expect(tensors, p + k, (b, hk, seq - bs0, d), dtype) for k in ("tail_k", "tail_v")]
            hist = []
            hq, n_fp = hk - len(layer.retrieval_heads), len(layer.retrieval_heads)  # quantized / retrieval heads
            for kv in ("k", "v"):
                hist.append(QuantizedRows(_expect(tensors, f"{p}hist_{kv}_codes", (b, hq, n, d // 4), torch.uint8),
                                          _expect(tensors, f"{p}hist_{kv}_scale", (b, hq, n, d // g), meta),
                                          _expect(tensors, f"{p}hist_{kv}_zero", (b, hq, n, d // g), meta)))
            fp_bits = config.retrieval_bits
            fp_kv = [tuple(_expect(tensors, p + name, (b, n_fp, seq, last), dt) for name, (last, dt)
                           in zip(_fp_names(kv, fp_bits), heads.part_specs(fp_bits, d, dtype)))
                     for kv in ("k", "v")] if n_fp else None
            mu_k_seq = None
            if config.key_offset == "prefill" and n > 0:
                mu_k_seq = _expect(tensors, p + "mu_k_seq", (b, hq, d), torch.float32).to(device)
            elif p + "mu_k_seq" in tensors:
                raise ValueError(f"layer {i}: the saved history is centered on per-sequence key means "
                                 "(key_offset='prefill'), this cache's config says key_offset='calibrated'")
            if isinstance(layer, CompiledOscarLayer):
                tail = [x[:, :, ts - bs0 :] for x in tail]  # (saves write buf_slot0 = tail_start)
                sink = [_sink_from_tail(x, t, pad, ts) for x, t in zip(sink, tail)]
                layer.import_state(dict(seq_len=seq, tail_start=ts, pad=pad.to(device), sink_k=sink[0].to(device),
                                        sink_v=sink[1].to(device), tail_k=tail[0].to(device), tail_v=tail[1].to(device),
                                        hist_k=QuantizedRows(*(x.to(device) for x in hist[0])),
                                        hist_v=QuantizedRows(*(x.to(device) for x in hist[1])), mu_k_seq=mu_k_seq,
                                        fp_k=tuple(x.to(device) for x in fp_kv[0]) if fp_kv else None,
                                        fp_v=tuple(x.to(device) for x in fp_kv[1]) if fp_kv else None))
                continue
            layer.lazy_initialization(tail[0][:, :, :0].to(device), tail[1][:, :, :0].to(device))
            layer.pad = pad.to(device)
            layer.pad_max = int(pad.max()) if pad.numel() else 0
            layer.sink_k, layer.sink_v = (x.to(device) for x in sink)
            cap = max(seq - bs0 + TAIL_SLACK, config.recent + CROP_RESERVE + TAIL_SLACK)
            layer.tail_k = tail[0].new_zeros(b, hk, cap, d, device=device)
            layer.tail_v = tail[1].new_zeros(b, hk, cap, d, device=device)
            layer.tail_k[:, :, : seq - bs0] = tail[0].to(device)
            layer.tail_v[:, :, : seq - bs0] = tail[1].to(device)
            layer.hist_k, layer.hist_v = (QuantizedRows(*(x.to(device) for x in h)) for h in hist)
            layer.seq_len, layer.tail_start, layer.buf_slot0 = seq, ts, bs0
            if fp_kv is not None:
                layer.fp_k, layer.fp_v = (tuple(x.to(device) for x in store) for store in fp_kv)
            layer.mu_k_seq = mu_k_seq
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
