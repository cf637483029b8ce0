"""`OscarRotations`: the rotation artifact. Per quantized layer ``i``: ``r_k``, ``r_v`` ``[Hk, D, D]`` float32
orthogonal (the history stores ``(k - mu_K) @ R_K``), optional offsets ``mu_k``, ``mu_v`` ``[Hk, D]``, clip ratios;
plus the model fingerprint and metadata. Its files and loading's checks: docs/usage.md, "Calibration".
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from .config import ModelFingerprint, validate_head_dim
from .hadamard import hadamard_matrix

logger = logging.getLogger("oscar_hf")

WEIGHTS_NAME = "oscar_rotations.safetensors"
CONFIG_NAME = "oscar_config.json"
FORMAT_VERSION = 1
BUILTIN_METHODS = ("identity", "hadamard")
REFERENCE_CLIP_K, REFERENCE_CLIP_V = 0.96, 0.92  # the authors' clip ratios (OscarRotations.from_reference)
ORTHOGONALITY_TOL = 1e-3


@dataclasses.dataclass
class LayerRotation:
    r_k: torch.Tensor  # [Hk, D, D]
    r_v: torch.Tensor  # [Hk, D, D]
    clip_k: float = 1.0
    clip_v: float = 1.0
    mu_k: torch.Tensor | None = None  # [Hk, D]
    mu_v: torch.Tensor | None = None  # [Hk, D]

    def map(self, fn_k, fn_v=None) -> "LayerRotation":
        """``r_k`` and ``mu_k`` through ``fn_k``, ``r_v`` and ``mu_v`` through ``fn_v`` (default ``fn_k``), made
        contiguous (the decode kernels read R row-major and would otherwise copy it at every step); clips kept."""
        fn_v = fn_k if fn_v is None else fn_v

        def f(fn, t):
            return None if t is None else fn(t).contiguous()

        return dataclasses.replace(self, r_k=f(fn_k, self.r_k), r_v=f(fn_v, self.r_v), mu_k=f(fn_k, self.mu_k),
                                   mu_v=f(fn_v, self.mu_v))

    def to(self, device) -> "LayerRotation":
        return self.map(lambda t: t.to(device))

    def select_heads(self, heads) -> "LayerRotation":
        """The rotations / offsets of the KV heads ``heads`` (a list of indices), in that order."""
        idx = torch.as_tensor(list(heads), dtype=torch.long, device=self.r_k.device)
        return self.map(lambda t: t.index_select(0, idx.to(t.device)))


@dataclasses.dataclass
class OscarRotations:
    """Rotations, offsets and clip ratios for every quantized layer of one model."""

    fingerprint: ModelFingerprint
    method: str
    layers: dict[int, LayerRotation]
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    # [num_layers, Hk] float32 >= 0: how much each KV head retrieves far-back facts (calibration.retrieval_heads)
    retrieval_scores: torch.Tensor | None = None

    @classmethod
    def builtin(cls, model_or_config, method: str = "hadamard") -> "OscarRotations":
        """Artifact-free ``identity`` or ``hadamard`` rotations for every full-attention layer."""
        fp = ModelFingerprint.from_config(getattr(model_or_config, "config", model_or_config))
        if method not in BUILTIN_METHODS:
            raise ValueError(
                f"method={method!r} needs a calibrated artifact (scripts/calibrate.py / oscar_hf.calibrate); "
                f"artifact-free methods are {BUILTIN_METHODS}")
        d, hk = fp.head_dim, fp.num_key_value_heads
        rot = (torch.eye(d) if method == "identity" else hadamard_matrix(d)).expand(hk, d, d).contiguous()
        layers = {i: LayerRotation(rot, rot) for i, t in enumerate(fp.layer_types) if t == "full_attention"}
        return cls(fp, method, layers, {"builtin": True})

    @classmethod
    def from_reference(cls, k_path: str | os.PathLike, v_path: str | os.PathLike, model_or_config, *,
                       clip_k: float = REFERENCE_CLIP_K, clip_v: float = REFERENCE_CLIP_V,
                       group_size: int | None = None, repo_id: str | None = None, subfolder: str | None = None,
                       revision: str | None = None, cache_dir: str | None = None, local_files_only: bool = False,
                       token: str | bool | None = None) -> "OscarRotations":
        """Convert the authors' rotation files (formats: :mod:`oscar_hf.reference_rotations`), local or in the Hub
        repo ``repo_id``, with their clips and one group per head by default (recorded for ``from_pretrained``)."""
        from .reference_rotations import read_reference_pair, resolve_file
        fp = ModelFingerprint.from_config(getattr(model_or_config, "config", model_or_config))
        g = fp.head_dim if group_size is None else int(group_size)
        validate_head_dim(fp, g)
        k_file, v_file = (resolve_file(p, repo_id, subfolder=subfolder, revision=revision, cache_dir=cache_dir,
                                       local_files_only=local_files_only, token=token) for p in (k_path, v_path))
        pairs, source = read_reference_pair(k_file, v_file, fp, ORTHOGONALITY_TOL)
        layers = {i: LayerRotation(r_k, r_v, float(clip_k), float(clip_v), mu_k=mu_k)  # k_mean as the key offset
                  for i, (r_k, r_v, mu_k) in pairs.items()}
        source.update(repo_id=repo_id, subfolder=subfolder, revision=revision)
        rot = cls(fp, "oscar-reference", layers, {"source": source, "group_size": g,
                                                  "shared_across_heads": source["shared_across_heads"]})
        rot.validate()
        return rot

    def validate(self) -> None:
        """Shapes, dtypes, finiteness, orthogonality and clip ranges; raises ValueError naming the culprit."""
        fp = self.fingerprint
        hk, d = fp.num_key_value_heads, fp.head_dim
        for i, lr in self.layers.items():
            if not 0 <= i < fp.num_layers:
                raise ValueError(f"artifact has rotations for layer {i}, but the model has {fp.num_layers} layers")
            for name in ("r_k", "r_v", "mu_k", "mu_v"):
                if name[0] == "r" or getattr(lr, name) is not None:  # (offsets are optional)
                    _check_tensor(f"layer {i} {name}", getattr(lr, name), (hk, d, d) if name[0] == "r" else (hk, d))
            for name in ("r_k", "r_v"):
                r = getattr(lr, name)
                err = (r.transpose(-1, -2) @ r - torch.eye(d, device=r.device)).abs().amax().item()
                if err > ORTHOGONALITY_TOL:
                    raise ValueError(f"layer {i} {name}: not orthogonal (max |RᵀR - I| = {err:.3g})")
            for name in ("clip_k", "clip_v"):
                c = getattr(lr, name)
                if not isinstance(c, float) or not 0.0 < c <= 1.0:
                    raise ValueError(f"layer {i} {name}: clip ratio must be a float in (0, 1], got {c!r}")
        if (s := self.retrieval_scores) is not None:
            _check_tensor("retrieval_scores", s, (fp.num_layers, hk))
            if (s < 0).any():
                raise ValueError("retrieval_scores: must be finite and non-negative")

    def top_retrieval_heads(self, k: int) -> tuple[tuple[int, int], ...]:
        """The ``k`` KV heads ``(layer, head)`` of quantized layers with the highest retrieval scores."""
        if k == 0:
            return ()
        if self.retrieval_scores is None:
            raise ValueError(
                "retrieval_heads=<int> needs retrieval scores in the rotation artifact: run "
                "scripts/find_retrieval_heads.py --artifact <dir> (or calibrate with --retrieval-probes), "
                "or pass explicit (layer, kv_head) pairs")
        n_q = len(self.layers) * self.retrieval_scores.shape[1]
        if not 0 < k <= n_q:
            raise ValueError(f"retrieval_heads={k}: must lie in [0, {n_q}] (KV heads of the quantized layers)")
        return tuple(ranked_heads(self.retrieval_scores, sorted(self.layers))[:k])

    def check_compatible(self, config) -> None:
        """Refuse an artifact made for another model, naming every mismatch."""
        other = ModelFingerprint.from_config(config)
        if problems := self.fingerprint.mismatches(other):
            raise ValueError(
                f"OSCAR rotations were calibrated for {self.fingerprint.name_or_path or self.fingerprint.architecture!r}"
                f" and do not fit this model ({other.name_or_path or other.architecture!r}): " + "; ".join(problems))
        if self.fingerprint.name_or_path and other.name_or_path and _model_name(self.fingerprint) != _model_name(other):
            logger.warning("OSCAR rotations were calibrated on %r, loading them into %r (same shapes)",
                           self.fingerprint.name_or_path, other.name_or_path)

    def save_pretrained(self, save_directory: str | os.PathLike, push_to_hub: bool = False, **hub_kwargs) -> None:
        from safetensors.torch import save_file
        self.validate()
        path = Path(save_directory)
        path.mkdir(parents=True, exist_ok=True)
        tensors, layer_meta = {}, {}
        for i, lr in sorted(self.layers.items()):
            for name in ("r_k", "r_v", "mu_k", "mu_v"):  # (offsets only where the layer has them)
                if getattr(lr, name) is not None:
                    tensors[f"layers.{i}.{name}"] = getattr(lr, name).detach().cpu().contiguous().clone()
            layer_meta[str(i)] = {"clip_k": lr.clip_k, "clip_v": lr.clip_v}
        if self.retrieval_scores is not None:
            tensors["retrieval_scores"] = self.retrieval_scores.detach().cpu().float().contiguous().clone()
        save_file(tensors, str(path / WEIGHTS_NAME), metadata={"format": "oscar_hf", "version": str(FORMAT_VERSION)})
        doc = dict(format_version=FORMAT_VERSION, method=self.method, fingerprint=self.fingerprint.to_dict(),
                   layers=layer_meta, metadata=self.metadata)
        (path / CONFIG_NAME).write_text(json.dumps(doc, indent=2, sort_keys=True))
        if push_to_hub:
            self.push_to_hub(save_directory=path, **hub_kwargs)

    def push_to_hub(self, repo_id: str | None = None, save_directory=None, token=None, private=None, **kw) -> str:
        from huggingface_hub import HfApi
        if repo_id is None:
            raise ValueError("push_to_hub needs repo_id='user/name'")
        api = HfApi(token=token)
        api.create_repo(repo_id, exist_ok=True, private=private)
        if save_directory is None:
            import tempfile
            with tempfile.TemporaryDirectory() as tmp:
                self.save_pretrained(tmp)
                return api.upload_folder(repo_id=repo_id, folder_path=tmp, **kw)
        return api.upload_folder(repo_id=repo_id, folder_path=str(save_directory), **kw)

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, revision: str | None = None, cache_dir: str | None = None,
                        local_files_only: bool = False, token: str | bool | None = None) -> "OscarRotations":
        """Load from a local directory or a Hub repo id (``HF_HUB_OFFLINE`` respected)."""
        path = Path(name_or_path)
        if path.is_dir():
            cfg_file, w_file = path / CONFIG_NAME, path / WEIGHTS_NAME
            for f in (cfg_file, w_file):
                if not f.is_file():
                    raise OSError(f"{path} is not an OSCAR rotation artifact: missing {f.name}")
        elif path.exists():
            raise OSError(f"{path} is a file; OSCAR rotations are a directory with {CONFIG_NAME} and {WEIGHTS_NAME}")
        else:
            name = str(name_or_path)
            if name.count("/") != 1 or name.startswith((".", "/")):
                raise OSError(f"OSCAR rotation artifact {name!r} not found (no such directory, and not a Hub repo id)")
            from huggingface_hub import hf_hub_download
            kw = dict(revision=revision, cache_dir=cache_dir, local_files_only=local_files_only, token=token)
            try:
                cfg_file, w_file = (Path(hf_hub_download(name, f, **kw)) for f in (CONFIG_NAME, WEIGHTS_NAME))
            except Exception as e:  # network, auth, offline mode: one clear OSError
                raise OSError(f"could not fetch OSCAR rotations {name!r} from the Hub: {e}") from e
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            doc = json.loads(cfg_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{cfg_file}: corrupted OSCAR config JSON ({e})") from None
        if not isinstance(doc, dict) or not all(isinstance(doc.get(k), dict) for k in ("fingerprint", "layers")):
            raise ValueError(f"{cfg_file}: not an OSCAR config (needs the objects 'fingerprint' and 'layers')")
        if doc.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{cfg_file}: unsupported format_version {doc.get('format_version')!r}")
        fp = ModelFingerprint.from_dict(doc["fingerprint"])
        try:
            tensors = load_file(str(w_file))
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ValueError(f"{w_file}: corrupted or truncated safetensors file ({e})") from None
        layers: dict[int, LayerRotation] = {}
        scores = tensors.pop("retrieval_scores", None)
        for key, meta in doc["layers"].items():
            try:
                i = int(key)
                clip_k, clip_v = float(meta["clip_k"]), float(meta["clip_v"])
            except (ValueError, TypeError, KeyError) as e:
                raise ValueError(f"{cfg_file}: bad layer entry {key!r}: {meta!r} ({e})") from None
            try:
                r_k, r_v = tensors.pop(f"layers.{i}.r_k"), tensors.pop(f"layers.{i}.r_v")
            except KeyError as e:
                raise ValueError(f"{w_file}: missing tensor {e.args[0]} for layer {i}") from None
            layers[i] = LayerRotation(
                r_k, r_v, clip_k, clip_v, tensors.pop(f"layers.{i}.mu_k", None), tensors.pop(f"layers.{i}.mu_v", None))
        if tensors:
            raise ValueError(f"{w_file}: unexpected tensors {sorted(tensors)[:5]} (no matching layer in {cfg_file.name})")
        rot = cls(fp, str(doc.get("method", "unknown")), layers, dict(doc.get("metadata") or {}), scores)
        rot.validate()
        return rot

    @property
    def has_offsets(self) -> bool:
        return any(lr.mu_k is not None or lr.mu_v is not None for lr in self.layers.values())

    def clips(self) -> dict[int, tuple[float, float]]:
        return {i: (lr.clip_k, lr.clip_v) for i, lr in sorted(self.layers.items())}

    def __repr__(self) -> str:
        return (
            f"OscarRotations(method={self.method!r}, model={self.fingerprint.name_or_path or self.fingerprint.architecture!r}, "
            f"layers={len(self.layers)}, kv_heads={self.fingerprint.num_key_value_heads}, head_dim={self.fingerprint.head_dim}, "
            f"offsets={self.has_offsets})")


def ranked_heads(scores: torch.Tensor, layers) -> list[tuple[int, int]]:
    """Every ``(layer, kv_head)`` of ``layers`` (ascending) by ``scores [num_layers, Hk]``, best first (stable)."""
    layers = list(layers)
    hk = scores.shape[1]
    order = torch.argsort(scores[layers].flatten(), descending=True, stable=True)
    return [(layers[int(j) // hk], int(j) % hk) for j in order]


def _check_tensor(what: str, x, shape: tuple[int, ...]) -> None:
    """A finite float32 tensor of ``shape``, else a ValueError starting with ``what``."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or tuple(x.shape) != shape:
        raise ValueError(f"{what}: expected a float32 tensor of shape {list(shape)}, got {getattr(x, 'dtype', type(x))} "
                         f"{tuple(getattr(x, 'shape', ()))}")
    if not torch.isfinite(x).all():
        raise ValueError(f"{what}: not finite (contains NaN or Inf)")


def _model_name(fp) -> str:
    """A Hub id as it is, a local folder by its last part (an installed model's path differs per machine)."""
    name = str(fp.name_or_path)
    return Path(name).name if os.path.isabs(name) else name
