"""The authors' rotation files (FutureMLS-Lab/OSCAR, ``rotation/compute_kv_rotation.py``: one for keys, one for
values), read with ``torch.load(weights_only=True)`` only and converted to our artifact. Formats 1 and 2 and what each
field becomes: docs/usage.md, "The authors' rotations and settings".
"""
from __future__ import annotations

import dataclasses
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from .config import FULL_LAYER_TYPES, ModelFingerprint

# format_version -> its source_grouping: one rotation per layer shared by its KV heads (1), one per KV head (2)
REFERENCE_GROUPINGS = {1: "layer", 2: "per_kv_head"}
UNUSED_FIELDS = ("q_rotation", "o_rotation")  # weight-folding rotations of format 2: read, not used by the cache


@dataclasses.dataclass
class ReferenceFile:
    """One validated rotation file: ``rotations[i]`` float32 ``[Hk, D, D]`` per layer ``i`` of the file (a layer's
    shared matrix repeated over its KV heads), ``k_means[i]`` float32 ``[Hk, D]`` where the file has one."""

    path: Path
    format_version: int
    objective: str
    rotations: dict[int, torch.Tensor]
    k_means: dict[int, torch.Tensor]
    shared: bool  # every layer's matrix shared by its heads (a [D, D] rotation)
    unused: list[str]  # the fields of UNUSED_FIELDS the file has


def resolve_file(path: str | os.PathLike, repo_id: str | None = None, *, subfolder: str | None = None,
                 revision: str | None = None, cache_dir: str | None = None, local_files_only: bool = False,
                 token: str | bool | None = None) -> Path:
    """A local file (``repo_id=None``), or ``path`` inside the Hub repo ``repo_id``; OSError when not found."""
    if repo_id is None:
        p = Path(path)
        if not p.is_file():
            why = "is a directory" if p.is_dir() else "does not exist"
            raise OSError(f"reference rotation file {str(p)!r} {why} (pass repo_id=... to read it from the Hub)")
        return p
    from huggingface_hub import constants, hf_hub_download
    # (HF_HUB_OFFLINE read now too: huggingface_hub's constant is read once, at its import)
    offline = (local_files_only or bool(getattr(constants, "HF_HUB_OFFLINE", False))
               or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"))
    try:
        return Path(hf_hub_download(repo_id, str(path), subfolder=subfolder, revision=revision, cache_dir=cache_dir,
                                    local_files_only=offline, token=token))
    except Exception as e:  # not found, network, auth, offline without a cached copy: one clear OSError
        where = f"{repo_id}/{subfolder + '/' if subfolder else ''}{path}"
        hint = " (offline: HF_HUB_OFFLINE / local_files_only, and no cached copy)" if offline else ""
        raise OSError(f"could not fetch reference rotation file {where!r} from the Hub{hint}: {e}") from e


def _safe_load(path: Path) -> Any:
    """``torch.load`` restricted to tensors and plain containers; anything else is a ValueError."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # weights_only refused it: a class to build or function to call ("GLOBAL posix.system"), or not a pickle
        lines = [ln.strip() for ln in str(e).splitlines() if "GLOBAL" in ln or "Unsupported" in ln]
        raise ValueError(
            f"{path}: not a plain-tensor rotation file -- torch.load(weights_only=True) refused it"
            f"{' (' + lines[0][:300] + ')' if lines else ''}; files whose pickle holds anything but tensors and "
            "plain containers are never unpickled here"
        ) from None
    except (RuntimeError, EOFError, ValueError, KeyError, AttributeError, TypeError) as e:
        raise ValueError(f"{path}: not a readable torch.save rotation file ({type(e).__name__}: {str(e)[:300]})") from None


def _per_head(path: Path, what: str, x, shapes: dict[tuple, str], hk: int) -> torch.Tensor:
    """A float tensor of one of ``shapes`` (``{shape: name}``, the first the layer's shared one, repeated over the
    ``hk`` heads; the others with a leading ``hk``), finite, as float32 with the leading ``hk``."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"{path}: {what}: expected a float tensor, got {getattr(x, 'dtype', type(x))}")
    if tuple(x.shape) not in shapes:
        raise ValueError(f"{path}: {what}: shape {tuple(x.shape)} does not match the model's "
                         + " or ".join(f"{tuple(s)} ({n})" for s, n in shapes.items()))
    x = x.detach().to(torch.float32)
    if not torch.isfinite(x).all():
        raise ValueError(f"{path}: {what}: contains NaN or Inf")
    shared = x.dim() == len(next(iter(shapes)))
    return (x.expand(hk, *x.shape) if shared else x).contiguous()


def read_reference_file(path: str | os.PathLike, head_dim: int, tol: float, num_kv_heads: int = 1) -> ReferenceFile:
    """Load and check one file (header; every rotation finite and orthogonal within ``tol``; ``k_mean``). Raises
    ValueError naming the file and the culprit."""
    path, d, hk = Path(path), head_dim, num_kv_heads
    doc = _safe_load(path)
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a dict with 'format_version' and 'layers', got {type(doc).__name__}")
    version = doc.get("format_version")
    if version not in REFERENCE_GROUPINGS:
        raise ValueError(f"{path}: unsupported format_version {version!r} "
                         f"(reference rotation files of format_version {sorted(REFERENCE_GROUPINGS)} are supported)")
    grouping = doc.get("source_grouping")
    if grouping != REFERENCE_GROUPINGS[version]:
        raise ValueError(f"{path}: unsupported source_grouping {grouping!r} for format_version {version} "
                         f"(expected {REFERENCE_GROUPINGS[version]!r})")
    objective = doc.get("objective", "")
    if not isinstance(objective, str):
        raise ValueError(f"{path}: 'objective' must be a string, got {type(objective).__name__}")
    layers = doc.get("layers")
    if not isinstance(layers, dict) or not layers:
        raise ValueError(f"{path}: 'layers' must be a non-empty dict {{layer: {{'rotation': tensor}}}}")
    rot_shapes = {(d, d): "one rotation for the layer"}
    mean_shapes = {(d,): "one mean for the layer"}
    if version == 2:
        rot_shapes[(hk, d, d)] = f"one per KV head, num_kv_heads={hk}"
        mean_shapes[(hk, d)] = f"one per KV head, num_kv_heads={hk}"
    out, means, shared, unused = {}, {}, True, set()
    for key, entry in layers.items():
        try:
            i = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"{path}: layer key {key!r} is not a layer index") from None
        if i in out:
            raise ValueError(f"{path}: layer {i} appears twice")
        if not isinstance(entry, dict) or "rotation" not in entry:
            raise ValueError(f"{path}: layer {i}: expected a dict with a 'rotation' tensor")
        if "layer_id" in entry and entry["layer_id"] != i:
            raise ValueError(f"{path}: layer {i} has layer_id={entry['layer_id']!r}")
        r = _per_head(path, f"layer {i} rotation", entry["rotation"], rot_shapes, hk)  # [Hk, D, D]
        shared &= entry["rotation"].dim() == 2  # (a tensor: _per_head checked it)
        err = (r.transpose(-1, -2) @ r - torch.eye(d)).abs().amax().item()
        if err > tol:
            raise ValueError(f"{path}: layer {i} rotation: not orthogonal (max |RᵀR - I| = {err:.3g} > {tol:g})")
        out[i] = r
        if entry.get("k_mean") is not None:
            if version < 2:
                raise ValueError(f"{path}: layer {i}: 'k_mean' is a format_version 2 field")
            means[i] = _per_head(path, f"layer {i} k_mean", entry["k_mean"], mean_shapes, hk)  # [Hk, D]
        unused.update(f for f in UNUSED_FIELDS if entry.get(f) is not None)
    return ReferenceFile(path, version, objective, out, means, shared, sorted(unused))


def read_reference_pair(k_file: str | os.PathLike, v_file: str | os.PathLike, fp: ModelFingerprint,
                        tol: float) -> tuple[dict[int, tuple], dict[str, Any]]:
    """``({layer: (r_k, r_v, mu_k)}, source metadata)`` of the model's full-attention layers from both files,
    checked against the model and each other: every full-attention layer in both, none beyond the model. Sliding
    layers' matrices may be absent; present, they are checked and dropped."""
    k, v = (read_reference_file(f, fp.head_dim, tol, fp.num_key_value_heads) for f in (k_file, v_file))
    if v.k_means:
        raise ValueError(f"{v.path}: a value rotation file with k_mean (key centering belongs to the key file)")
    full = [i for i, t in enumerate(fp.layer_types) if t in FULL_LAYER_TYPES]
    for f in (k, v):
        extra = sorted(i for i in f.rotations if not 0 <= i < fp.num_layers)
        if extra:
            raise ValueError(f"{f.path}: rotations for layers {extra}, but the model has {fp.num_layers} layers "
                             f"(0..{fp.num_layers - 1}): a file for another model?")
        missing = [i for i in full if i not in f.rotations]
        if missing:
            raise ValueError(f"{f.path}: no rotation for full-attention layers {missing} of the model "
                             f"({len(full)} full-attention layers of {fp.num_layers})")
    if set(k.rotations) != set(v.rotations):  # (can differ only in sliding layers here)
        only_k, only_v = sorted(set(k.rotations) - set(v.rotations)), sorted(set(v.rotations) - set(k.rotations))
        raise ValueError(f"key and value rotation files disagree: layers only in {k.path.name}: {only_k}, "
                         f"only in {v.path.name}: {only_v}")
    if k.k_means and any(i not in k.k_means for i in full):
        raise ValueError(f"{k.path}: k_mean for some full-attention layers but not for "
                         f"{[i for i in full if i not in k.k_means]}")
    version = max(k.format_version, v.format_version)
    source = dict(
        format="FutureMLS-Lab/OSCAR rotation files (rotation/compute_kv_rotation.py)", format_version=version,
        source_grouping=REFERENCE_GROUPINGS[version], shared_across_heads=k.shared and v.shared,
        key_centering=bool(k.k_means), unused_fields=sorted(set(k.unused) | set(v.unused)), k_file=k.path.name,
        v_file=v.path.name, k_objective=k.objective, v_objective=v.objective, layers_in_files=len(k.rotations))
    # r_k, r_v [Hk, D, D] (a format-1 matrix repeated over the heads); mu_k: the key file's k_mean [Hk, D] or None
    return {i: (k.rotations[i], v.rotations[i], k.k_means.get(i)) for i in full}, source

