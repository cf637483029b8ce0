"""The cache: :class:`OscarCache`, a ``transformers.Cache`` whose full-attention layers are OSCAR layers; on CUDA
its storage is device-resident and ``generate`` compiles the decode step by itself (:mod:`.static`, growing in
capacity buckets), elsewhere it is the eager reference (:mod:`.dynamic`). :class:`StaticOscarCache` fixes the
capacity (``max_cache_len``).

The eager layer keeps a layout of its own (a growing tail instead of the compiled layer's fixed sink + ring) because
it reads any attention mask exactly (holes, custom 4D masks) and equals a ``DynamicCache`` bit for bit until its first
demotion; both layers, and the serving store, share one :class:`~oscar_hf.cache.params.LayerParams` per layer, the
write kernels and the reads (the INT2 decode op, the retrieval heads' kernel). The compiled layer and the serving
store also share one storage model, written once in :mod:`.window`: a sink + ring window, and a history of INT2 rows
and the retrieval heads' coded rows (``LayerParams.encode_history``), addressed as rows or as pages.

Data flow: an artifact (:class:`~oscar_hf.OscarRotations`) -> a cache layer per decoder layer
(:mod:`.dynamic` / :mod:`.static`: write path + read) -> the registered attention function
(:mod:`oscar_hf.attention`) that hands each call to its layer; :mod:`.io` saves and loads a live cache.

    cache = OscarCache.from_pretrained("rotations_dir", model)   # or OscarCache(model, method="hadamard")
    model.generate(**inputs, cache=cache)   # Transformers without `cache=` (e.g. 5.17): past_key_values=cache
"""
from __future__ import annotations

import copy
import logging
import weakref
from typing import Any

import torch
from transformers.cache_utils import (
    Cache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionAndStaticSlidingWindowAttentionLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
    StaticSlidingWindowLayer,
)

try:  # Transformers >= 5.2x: the layer of KV sharing's reuse layers (and MoE / MLP-only layers); 5.17 leaves them out
    from transformers.cache_utils import DummyLayer
except ImportError:  # pragma: no cover - transformers 5.17
    DummyLayer = None

from ..attention import enable_oscar
from ..compiled_step import install_step_hook
from ..config import (
    DUMMY_LAYER_TYPE,
    FULL_LAYER_TYPES,
    FULL_PRECISION_LAYER_TYPES,
    FULL_PRECISION_WHY,
    SHARED_KV_LAYER_TYPE,
    SLIDING_LAYER_TYPES,
    STATE_LAYER_TYPES,
    ModelFingerprint,
    OscarConfig,
    artifact_settings,
    hybrid_state_layers,
    starting_config,
    validate_head_dim,
)
from ..distributed import shard_cache_for_tensor_parallel
from ..rotations import LayerRotation, OscarRotations
from .dynamic import OscarLayer
from .growing import GrowingLayer
from .hybrid import OscarHybridLayer, StaticOscarHybridLayer
from .io import load_cache, save_cache
from .static import StaticOscarLayer, StepShared

logger = logging.getLogger("oscar_hf")
_SAID: set[tuple[str, str]] = set()  # (architecture, layer kind) whose full-precision reason was logged

__all__ = ["OscarCache", "StaticOscarCache", "OscarLayer", "StaticOscarLayer", "OscarHybridLayer", "StaticOscarHybridLayer",
           "GrowingLayer", "resolve_full_precision_heads"]


def resolve_full_precision_heads(config: OscarConfig, rotations: OscarRotations, fp: ModelFingerprint,
                                 skipped: set[int]) -> dict[int, tuple[int, ...]]:
    """``{layer: kv heads}`` kept in full precision (``OscarConfig.full_precision_heads``), checked against the model:

    * ``"auto"``: the artifact's retrieval heads scoring at least ``config.retrieval_threshold``, best first, at most
      ``config.full_precision_head_budget(...)`` of them (average history bits within ``max_history_bits``); none
      when the rotations have no retrieval scores (built-in methods, artifacts calibrated without probes);
    * an int ``k``: the artifact's ``k`` best retrieval heads; pairs: those heads.

    Heads of unquantized layers (skipped, sliding, without rotation) are left out, being full precision already."""
    want = config.full_precision_heads
    if want == "auto":
        # the quantized layers' KV heads: the ones the INT2 history (and the bit budget) is about
        quantized = [i for i in sorted(rotations.layers)
                     if i not in skipped and 0 <= i < fp.num_layers and fp.layer_types[i] in FULL_LAYER_TYPES]
        scores = rotations.retrieval_scores
        if scores is None:
            logger.info("full_precision_heads='auto': the %s rotations have no retrieval scores, no full-precision "
                        "heads", rotations.method)
            pairs = ()
        else:
            budget = config.full_precision_head_budget(fp.head_dim, len(quantized) * fp.num_key_value_heads)
            s = scores[quantized].flatten()  # [len(quantized) * Hk]
            order = torch.argsort(s, descending=True, stable=True)
            hk = fp.num_key_value_heads
            passing = [(quantized[int(j) // hk], int(j) % hk) for j in order if s[j] >= config.retrieval_threshold]
            pairs = tuple(passing[:budget])
            logger.info("full_precision_heads='auto': %d of %d heads score >= %.2f, budget %d (history <= %.2f bits): "
                        "%s", len(passing), s.numel(), config.retrieval_threshold, budget, config.max_history_bits,
                        list(pairs))
    elif isinstance(want, int):
        pairs = rotations.top_retrieval_heads(want)
    else:
        pairs = want
    out: dict[int, list[int]] = {}
    for i, h in pairs:
        if not 0 <= i < fp.num_layers or not 0 <= h < fp.num_key_value_heads:
            raise ValueError(f"full_precision_heads: ({i}, {h}) is not a (layer, kv_head) of this model "
                             f"({fp.num_layers} layers, {fp.num_key_value_heads} KV heads)")
        if i in rotations.layers and i not in skipped and fp.layer_types[i] in FULL_LAYER_TYPES:
            out.setdefault(i, []).append(h)
    return {i: tuple(sorted(hs)) for i, hs in out.items()}


# layer kinds that compile="auto" compiles on CUDA: measured there (docs/results.md, "Other architectures": Gemma 2 / 3,
# gpt-oss, Qwen3-Next, Falcon-H1 2-5x the eager storage and ~2x compiled StaticCache at B=8/32K); the others need
# compile=True
# the layouts a GPU run measured compiled against the eager storage (docs/results.md, "Other architectures"); hybrid
# layers count as full attention; KV sharing: the store layer and the reuse layers' dummies (Gemma 3n)
AUTO_COMPILED_LAYER_TYPES = (FULL_LAYER_TYPES + SLIDING_LAYER_TYPES + STATE_LAYER_TYPES
                             + (SHARED_KV_LAYER_TYPE, DUMMY_LAYER_TYPE))
_SAID_EAGER: set[str] = set()  # the reasons already logged (once per process each)


def not_auto_compiled(fp: ModelFingerprint) -> str | None:
    """What keeps ``compile="auto"`` on the eager storage for this model on CUDA (``None``: nothing): layer kinds
    the compiled storage serves (``compile=True``) but that no GPU run has measured -- MLA latents and values of
    another head size (full precision both)."""
    other = sorted({k for k in fp.layer_types if k not in AUTO_COMPILED_LAYER_TYPES})
    return f"{' / '.join(other)} layers" if other else None


def model_on_cuda(model) -> bool:
    """Whether ``compile="auto"`` sees a model on CUDA (any of its parameters)."""
    return model is not None and any(p.is_cuda for p in model.parameters())


def _say_eager_once(message: str) -> None:
    """A warning, once per process for each message: a CUDA model whose decode step ``generate`` will not compile."""
    if message not in _SAID_EAGER:
        _SAID_EAGER.add(message)
        logger.warning(message)


_SAID_MISSING: set[tuple] = set()  # (architecture, missing layers) already warned about


def _warn_missing_rotations(fp: ModelFingerprint, rotations: OscarRotations, skipped) -> None:
    """A warning, once per process for each model and set of layers: full-attention layers (not skipped by the
    config) that the rotation artifact has no rotation for, and that therefore stay unquantized."""
    missing = tuple(i for i, t in enumerate(fp.layer_types)
                    if t in FULL_LAYER_TYPES and i not in skipped and i not in rotations.layers)
    if missing and (fp.architecture, missing) not in _SAID_MISSING:
        _SAID_MISSING.add((fp.architecture, missing))
        logger.warning("OscarCache: the rotation artifact has no rotation for full-attention layer%s %s of %s: %s "
                       "stay%s unquantized, in the model's dtype (BF16), not INT2", "s" * (len(missing) > 1),
                       ", ".join(map(str, missing)), fp.name_or_path or fp.architecture,
                       "they" if len(missing) > 1 else "it", "" if len(missing) > 1 else "s")


class OscarCache(Cache):
    """Drop-in KV cache for ``generate(cache=...)`` (``past_key_values=`` on
    Transformers versions without ``cache=``, e.g. 5.17): 2-bit OSCAR
    history, full-precision sink + recent.

    ``OscarCache(model, rotations=None, config=None, *, preset=None, **overrides)`` with ``rotations`` an
    :class:`OscarRotations` (e.g. from ``scripts/calibrate.py``) or None for the artifact-free
    ``method`` ("identity" / "hadamard"); overrides are :class:`OscarConfig` fields. Without ``config`` and
    ``preset``, the settings the calibration chose for the model (``calibrate(choose_settings=True)``, the artifact's
    ``metadata["settings"]``) replace :class:`OscarConfig`'s defaults, the overrides on top; artifacts without them
    start from the defaults (``from_pretrained`` also applies their calibrated group size). The cache routes
    the model's attention through OSCAR (:func:`~oscar_hf.enable_oscar`); the user's attention
    implementation still serves every layer OSCAR does not quantize. ``model_or_config`` is the model,
    or the model's own config (``model.config``, which the model reads at every forward; the model is
    needed for tensor parallelism, whose KV-head slices are read from its weights).
    Layers (:meth:`layer_kinds`; ``oscar_hf.config.layer_types_of`` reads the kinds): full attention ->
    :class:`OscarLayer` (a "hybrid" layer, Falcon-H1 / Zamba: :class:`OscarHybridLayer`, with Transformers'
    ``LinearAttentionLayer`` state); sliding-window / chunked -> Transformers' full-precision
    ``DynamicSlidingWindowLayer`` (bounded by its window already); linear attention / SSM / convolution ->
    Transformers' ``LinearAttentionLayer``; ``skip_layers``, MLA latents (DeepSeek-V2/V3, ...) and KV sharing's
    store layers (Gemma 3n / 4) -> ``DynamicLayer`` (the reason is logged once at construction:
    ``oscar_hf.config.FULL_PRECISION_WHY``); KV sharing's reuse layers -> ``DummyLayer`` (nothing cached).

    ``compile``: "auto" (default) keeps the storage on the device in fixed-address buffers
    (:class:`StaticOscarLayer`, capacity growing in buckets) when the model is on CUDA and its layers are full
    attention (soft-capped or not), sliding-window / chunked (Transformers' ``StaticSlidingWindowLayer``, a buffer of
    the window's width, beside the compiled OSCAR layers; the compiled step is traced up to three times as that layer
    fills, and it cannot ``crop`` once it rolls), linear attention or hybrid attention + state (layers kept in full
    precision as :class:`GrowingLayer`), with no tensor parallelism, so that ``generate`` compiles the decode step with
    CUDA graphs by itself; where it does not, the reason is logged as a warning once. True asks for that storage
    anywhere (the CPU runs its torch reference), and also serves tensor parallelism (each rank's layers hold its KV
    heads) and the full-precision layers of MLA / KV-sharing models; False keeps the eager :class:`OscarLayer`.
    """

    def __init__(self, model_or_config, rotations: OscarRotations | None = None, config: OscarConfig | None = None, *,
                 preset: str | None = None, compile: bool | str = "auto", **overrides):
        if compile not in (True, False, "auto"):
            raise ValueError(f"compile must be True, False or 'auto', got {compile!r}")
        # without config / preset: the settings calibration chose for this model (calibrate(choose_settings=True)),
        # under the user's keywords; a group size nobody chose is fitted to the model's head_dim (for_head_dim)
        config, default_group = starting_config(config, preset, rotations, overrides)
        is_model = isinstance(model_or_config, torch.nn.Module)
        model_config = model_or_config.config if is_model else model_or_config
        text_cfg = model_config.get_text_config(decoder=True)
        if rotations is None:
            rotations = OscarRotations.builtin(model_config, config.method)
        else:
            rotations.check_compatible(model_config)
        fp = ModelFingerprint.from_config(model_config)
        # group_size=None (the "paper" preset): one group per head; the default 64 where it does not divide head_dim: 48 at 96
        config = config.for_head_dim(fp.head_dim, default_group=default_group)
        validate_head_dim(fp, config.group_size)
        cal_g = rotations.metadata.get("group_size")
        if cal_g is not None and int(cal_g) != config.group_size:
            logger.warning("rotations were calibrated for group_size=%s, cache uses %s", cal_g, config.group_size)
        skipped = config.skipped(fp.num_layers)
        _warn_missing_rotations(fp, rotations, skipped)
        fp_heads = resolve_full_precision_heads(config, rotations, fp, skipped)
        if fp_heads:  # the saved / reported config names the heads, not "the top k"
            config = config.replace(full_precision_heads=tuple(sorted((i, h) for i, hs in fp_heads.items() for h in hs)))
        # a layer whose every head is exact is Transformers' own layer; at INT4 / INT8 it stays an OSCAR layer with
        # no INT2 head, so that it keeps the stored form (and the bits) it was chosen at
        exact_layers = {i for i, hs in fp_heads.items()
                        if len(hs) == fp.num_key_value_heads and config.full_precision_bits == 16}
        hybrid = hybrid_state_layers(text_cfg)  # attention + a state in one layer (Falcon-H1, Zamba)
        self.compiled = self._compiled_storage(compile, model_or_config if is_model else None, fp, rotations, skipped,
                                               exact_layers, hybrid)
        self._n_states = getattr(text_cfg, "number_of_conv_states", 1)
        layers: list[Any] = []
        for i, kind in enumerate(fp.layer_types):
            if kind in SLIDING_LAYER_TYPES:
                window = getattr(text_cfg, "sliding_window", None) if kind == "sliding_attention" else text_cfg.attention_chunk_size
                layers.append(self._sliding_layer(window, i in hybrid))
            elif kind in STATE_LAYER_TYPES:  # no per-token K/V: Transformers' own state layer (compileable as it is)
                layers.append(LinearAttentionLayer(number_of_states=self._n_states))
            elif kind in FULL_LAYER_TYPES:
                if i in skipped or i not in rotations.layers or i in exact_layers:
                    layers.append(self._full_precision_layer(i in hybrid))
                else:
                    layers.append(self._oscar_layer(config, rotations.layers[i], i, fp_heads.get(i, ()), i in hybrid))
            elif kind in FULL_PRECISION_LAYER_TYPES:  # MLA latents, KV sharing's store layers: Transformers' own kind
                layers.append(self._full_precision_layer(False))
            elif kind == DUMMY_LAYER_TYPE:  # caches nothing (KV sharing's reuse layers)
                layers.append(DummyLayer() if DummyLayer is not None else None)
            else:
                raise NotImplementedError(f"{fp.architecture}: layer type {kind!r} (layer {i}) is not supported by OscarCache")
        if None in layers:  # Transformers 5.17 (no DummyLayer) builds no layer for the trailing reuse layers either
            n = layers.index(None)
            if any(x is not None for x in layers[n:]):
                raise NotImplementedError(f"{fp.architecture}: layers that cache nothing before caching ones need "
                                          "Transformers' DummyLayer (transformers >= 5.2x)")
            layers = layers[:n]
        super().__init__(layers=layers)
        static = [x for x in layers if isinstance(x, StaticOscarLayer)]
        if static:  # one decode forward's window mask and history length, computed by its first OSCAR layer
            step = StepShared()
            step.last_layer = max(x.layer_idx for x in static)
            for x in static:
                x.step = step
        # a compiled full-precision layer's decode step returns all C slots of its buffers: every full-attention
        # layer's mask is then its (C, 0) (an OSCAR layer reads none in a decode step)
        self._mask_layer = next((i for i, x in enumerate(layers) if isinstance(x, GrowingLayer)), None)
        self.oscar_config, self.rotations, self.fingerprint = config, rotations, fp
        self._model_ref = weakref.ref(model_or_config) if is_model else None  # save's weights digest (io.py)
        self.tp_layout = None  # [tensor parallelism] set by oscar_hf/distributed.py: each rank keeps its own KV heads
        self._log_layer_plan(fp, hybrid)
        if is_model:
            shard_cache_for_tensor_parallel(self, model_or_config)  # [tensor parallelism] no-op without TP
            if self.compiled:
                install_step_hook(model_or_config)  # host-side length and capacity growth around the compiled step
        enable_oscar(model_or_config)

    max_cache_len_fixed: int | None = None  # StaticOscarCache's capacity
    _mask_layer: int | None = None

    def _log_layer_plan(self, fp: ModelFingerprint, hybrid: set[int]) -> None:
        """Says at construction, in one line per reason, which attention layers stay in full precision and why
        (``layer_kinds``): a warning when nothing is quantized, else info; the next caches of the architecture (a
        fresh cache per ``generate`` call) at debug level."""
        kinds = self.layer_kinds()
        n_q = sum(k.startswith("oscar") for k in kinds)
        for kind, why in FULL_PRECISION_WHY.items():
            idx = [i for i, t in enumerate(fp.layer_types) if t == kind]
            if idx:
                first = (fp.architecture, kind) not in _SAID
                _SAID.add((fp.architecture, kind))
                level = (logging.WARNING if n_q == 0 else logging.INFO) if first else logging.DEBUG
                logger.log(level, "OscarCache: %d of %d layers of %s kept in full precision (Transformers' own layer, "
                           "%s storage), %d quantized: %s", len(idx), fp.num_layers, fp.architecture,
                           "compiled" if self.compiled else "eager", n_q, why)
        if hybrid and n_q:
            logger.debug("OscarCache: %d hybrid layers of %s: OSCAR attention beside Transformers' linear-attention / "
                         "SSM state", len(hybrid), fp.architecture)

    def layer_kinds(self) -> list[str]:
        """What each decoder layer got, in order: ``"oscar"`` (INT2 history; ``"oscar+state"`` for a hybrid layer),
        ``"sliding"`` (Transformers' full-precision window), ``"state"`` (linear attention / SSM / convolution),
        ``"latent"`` (MLA latent, full precision), ``"shared_kv"`` (KV sharing's store layer, full precision),
        ``"full_precision"`` (skipped layers, layers without rotations), ``"none"`` (caches nothing)."""
        named = {"latent_attention": "latent", "shared_kv_attention": "shared_kv", "unequal_kv_attention": "full_precision"}
        out = []
        for i, t in enumerate(self.fingerprint.layer_types):
            layer = self.layers[i] if i < len(self.layers) else None
            if isinstance(layer, (OscarLayer, StaticOscarLayer)):
                out.append("oscar+state" if isinstance(layer, LinearAttentionCacheLayerMixin) else "oscar")
            elif t in named:
                out.append(named[t])
            elif t in SLIDING_LAYER_TYPES:
                out.append("sliding")
            elif t in STATE_LAYER_TYPES:
                out.append("state")
            elif t == DUMMY_LAYER_TYPE:
                out.append("none")
            else:
                out.append("full_precision")
        return out

    def _compiled_storage(self, compile, model, fp: ModelFingerprint, rotations, skipped, exact_layers,
                          hybrid=()) -> bool:
        """Whether the full-attention layers get device-resident storage (:class:`StaticOscarLayer`)."""
        if compile is False:
            return False
        why = None
        growable = self.max_cache_len_fixed is None
        # full-attention layers kept in full precision are GrowingLayers beside the OSCAR layers, except a hybrid one:
        # its state would need a growing hybrid layer, which does not exist
        kept = {i for i, k in enumerate(fp.layer_types)
                if k in FULL_LAYER_TYPES and (i in skipped or i not in rotations.layers or i in exact_layers)}
        if kept & set(hybrid):
            why = "a hybrid (attention + state) layer kept in full precision (skip_layers, BF16 full-precision heads)"
        elif model is not None and any(m._backward_hooks or m._backward_pre_hooks for m in model.modules()):
            # Transformers 5.17's tensor-parallel layers register these; dynamo refuses them ("Module-level backwards
            # hooks require compiled autograd"), so generate's compiled step would fail (5.24's TP layers do not)
            why = "a model with module backward hooks (tensor parallelism on Transformers 5.17), which torch.compile cannot trace"
        if compile == "auto":
            on_cuda = model_on_cuda(model)
            # tensor parallelism compiles (each rank's layers hold its own KV heads; checked on the CPU under
            # torchrun + gloo) but is not measured on GPUs yet
            tp = model is not None and (getattr(model, "_tp_size", None) or 1) > 1
            if on_cuda and why:
                _say_eager_once(f"OscarCache: eager storage, not compiled (the compiled decode step does not support "
                                f"{why})")
            elif on_cuda and growable and (unmeasured := "tensor parallelism" if tp else not_auto_compiled(fp)):
                _say_eager_once(f"OscarCache: eager storage, not compiled, for a model with {unmeasured} "
                                f"(compile=True compiles it; not measured on a GPU, so not the default)")
                return False
            return on_cuda and why is None
        if why:
            raise ValueError(f"OscarCache(compile=True) does not support {why}")
        return True

    # Layer factories: eager (OscarLayer) or device-resident (StaticOscarLayer) storage.
    # ``state``: a "hybrid" layer's linear-attention / SSM state goes with it (Transformers' LinearAttentionLayer).
    def _sliding_layer(self, window: int, state: bool = False):
        n = self._n_states
        if self.compiled:
            # a bounded buffer of the window's width, whatever the generation's length (crop refused once it rolls)
            cap = self.max_cache_len_fixed or 2**62
            if state:
                return LinearAttentionAndStaticSlidingWindowAttentionLayer(max_cache_len=cap, sliding_window=window,
                                                                           number_of_states=n)
            return StaticSlidingWindowLayer(max_cache_len=cap, sliding_window=window)
        if state:
            return LinearAttentionAndSlidingWindowAttentionLayer(sliding_window=window, number_of_states=n)
        return DynamicSlidingWindowLayer(sliding_window=window)

    def _full_precision_layer(self, state: bool = False):
        n = self._n_states
        if not self.compiled:
            return LinearAttentionAndFullAttentionLayer(number_of_states=n) if state else DynamicLayer()
        if state:  # (_compiled_storage refuses the compiled storage for it)
            raise NotImplementedError("a hybrid layer kept in full precision (skip_layers) needs compile=False")
        return GrowingLayer(self.max_cache_len_fixed)

    def _oscar_layer(self, config: OscarConfig, rotation: LayerRotation, layer_idx: int, fp_heads=(), state=False):
        n = self._n_states
        if self.compiled:
            if state:
                return StaticOscarHybridLayer(config, rotation, layer_idx, fp_heads, self.max_cache_len_fixed,
                                              number_of_states=n)
            return StaticOscarLayer(config, rotation, layer_idx, self.max_cache_len_fixed, fp_heads)
        if state:
            return OscarHybridLayer(config, rotation, layer_idx, fp_heads, number_of_states=n)
        return OscarLayer(config, rotation, layer_idx, fp_heads)

    @classmethod
    def from_pretrained(cls, name_or_path, model, config: OscarConfig | None = None, *, preset: str | None = None,
                        revision=None, cache_dir=None, local_files_only=False, token=None, **overrides) -> "OscarCache":
        """Load a rotation artifact (local dir or Hub repo id) and build a cache for ``model``."""
        rot = OscarRotations.from_pretrained(
            name_or_path, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only, token=token
        )
        if (config is None and preset is None and "group_size" not in overrides
                and artifact_settings(rot.metadata) is None):
            # (an artifact with chosen settings has its group size there: the constructor applies them)
            # the group size the clips were chosen for: top level (hand-written artifacts) wins over where
            # calibrate() records it, metadata["calibration"]["group_size"]
            cal = rot.metadata.get("calibration")
            g = rot.metadata.get("group_size")
            if g is None and isinstance(cal, dict):
                g = cal.get("group_size")
            if g is not None:
                overrides["group_size"] = int(g)
        return cls(model, rot, config, preset=preset, **overrides)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        if self._mask_layer is not None and isinstance(layer, StaticOscarLayer):
            return self.layers[self._mask_layer].get_mask_sizes(query_length)  # the full-attention layers' one mask
        return super().get_mask_sizes(query_length, layer_idx)

    # ------------------------------------------------------------------ persistence
    def save(self, directory) -> None:
        """Write the live cache (INT2 history, windows, positions, rotations) to ``directory``. Refused
        (NotImplementedError, nothing written) for a cache holding a linear-attention / SSM / convolution state."""
        for i, layer in enumerate(self.layers):
            if isinstance(layer, LinearAttentionCacheLayerMixin):  # hybrid OSCAR layers too: their state would be lost
                raise NotImplementedError(f"cannot save cache layer {i}: {type(layer).__name__} holds a linear-attention"
                                          " / SSM / convolution state (Transformers' LinearAttentionLayer), which "
                                          "OscarCache.save does not serialize")
        view = copy.copy(self)  # the saved form of the layers io does not know: the same tokens as DynamicLayers
        view.layers = [self._saved_layer(layer) for layer in self.layers]
        save_cache(view, directory)

    @staticmethod
    def _saved_layer(layer):
        """``layer`` in the form :mod:`.io` saves (the eager storage's), loaded back into either storage."""
        if isinstance(layer, GrowingLayer) or (DummyLayer is not None and isinstance(layer, DummyLayer)):
            out = DynamicLayer()  # a DummyLayer caches nothing: saved empty, and load leaves it as it is
            if isinstance(layer, GrowingLayer) and layer.is_initialized and layer.host_len:
                out.update(*layer.used())  # loads back through GrowingLayer.update / DynamicLayer.update
            return out
        if isinstance(layer, StaticSlidingWindowLayer):
            # its W slots hold the last min(T, W) tokens in order; DynamicSlidingWindowLayer's the last min(T, W - 1)
            w, t = layer.max_cache_len, layer.cumulative_length_int
            out = DynamicSlidingWindowLayer(sliding_window=w)
            if layer.is_initialized and t:
                keep = slice(1, None) if t >= w else slice(0, t)
                out.update(layer.keys[:, :, keep], layer.values[:, :, keep])
                out.cumulative_length = t
            return out
        return layer

    @classmethod
    def load(cls, directory, model, device=None, compile: bool | str = "auto") -> "OscarCache":
        """Load a cache written by :meth:`save` to continue generation exactly where it stopped (into either storage,
        whichever wrote it: ``compile`` as in the constructor)."""
        return load_cache(cls, directory, model, device, compile=compile)

    # ------------------------------------------------------------------ reporting
    def memory_report(self) -> dict[str, float]:
        """Bytes by part (summed over layers), bits per element, and the BF16 DynamicCache equivalent.

        ``full_precision_layers``: bytes of the layers kept in Transformers' own full-precision form (sliding windows,
        ``skip_layers``, MLA latents, KV sharing's store layers: :meth:`layer_kinds` says which, the cache's log at
        construction why; for MLA see ``oscar_hf.config.FULL_PRECISION_WHY``: the latent, already ~71x smaller than
        per-head K/V, is expanded through ``kv_b_proj`` at every step, so an INT2 latent would need a full-precision
        copy of its history every step); ``quantized_layers`` / ``latent_layers`` / ``shared_kv_layers``: how many
        layers are OSCAR layers / MLA latents / KV sharing's store layers."""
        tot = dict(sink=0, recent=0, history_codes=0, history_meta=0, history_elements=0, full_precision_heads=0,
                   allocated=0, full_precision_layers=0)
        elements = 0
        for layer in self.layers:
            if hasattr(layer, "memory"):  # OscarLayer and the static StaticOscarLayer
                m = layer.memory()
                for k in ("sink", "recent", "history_codes", "history_meta", "history_elements", "allocated"):
                    tot[k] += m[k]
                tot["full_precision_heads"] += m.get("full_precision_heads", 0)
                if layer.is_initialized:
                    elements += 2 * m["tokens"] * layer.num_kv_heads * layer.head_dim
            elif getattr(layer, "is_initialized", False) and getattr(layer, "keys", None) is not None:
                kv = layer.used() if isinstance(layer, GrowingLayer) else (layer.keys, layer.values)
                nb = sum(x.numel() * x.element_size() for x in kv)  # (an MLA latent's K and V widths differ)
                tot["full_precision_layers"] += nb
                tot["allocated"] += sum(x.numel() * x.element_size() for x in (layer.keys, layer.values))
                elements += sum(x.numel() for x in kv)
        kinds = self.layer_kinds()
        tot["quantized_layers"] = sum(k.startswith("oscar") for k in kinds)
        tot["latent_layers"] = kinds.count("latent")
        tot["shared_kv_layers"] = kinds.count("shared_kv")
        used = (tot["sink"] + tot["recent"] + tot["history_codes"] + tot["history_meta"] + tot["full_precision_layers"]
                + tot["full_precision_heads"])
        tot["total"] = used
        tot["bf16_equivalent"] = 2 * elements
        tot["bits_per_element"] = 8 * used / elements if elements else float("nan")
        tot["compression_vs_bf16"] = tot["bf16_equivalent"] / used if used else float("nan")
        # the history's average over the quantized layers' KV heads, full-precision heads at their stored bits
        q_layers = [layer for layer in self.layers if hasattr(layer, "memory")]
        n_heads = len(q_layers) * self.fingerprint.num_key_value_heads
        share = sum(len(layer.fp_heads) for layer in q_layers) / n_heads if n_heads else 0.0
        tot["history_bits_per_element"] = self.oscar_config.history_bits(self.fingerprint.head_dim, share)
        return tot

    def __repr__(self) -> str:
        n_q = sum(hasattr(layer, "memory") for layer in self.layers)
        c = self.oscar_config
        return (
            f"OscarCache(method={self.rotations.method!r}, quantized_layers={n_q}/{len(self.layers)}, sink={c.sink}, "
            f"recent={c.recent}, group_size={c.group_size}, seq_len={self.get_seq_length()})"
        )


class StaticOscarCache(OscarCache):
    """:class:`OscarCache` with device-resident storage of a fixed capacity: ``max_cache_len`` slots (prompt + new
    tokens, left padding included). ``OscarCache`` does the same on CUDA by itself, growing as needed; this class is
    for a known bound, and for models with sliding-window or ``skip_layers`` layers (Transformers'
    ``StaticSlidingWindowLayer`` / :class:`GrowingLayer` of that capacity). The batch size is taken from the first
    forward and fixed."""

    def __init__(self, model_or_config, rotations=None, config: OscarConfig | None = None, *, max_cache_len: int,
                 **overrides):
        if max_cache_len is None or int(max_cache_len) < 1:
            raise ValueError("StaticOscarCache needs max_cache_len >= 1 (prompt + new tokens, padding included)")
        if overrides.pop("compile", True) is not True:
            raise ValueError("StaticOscarCache is the compiled storage; use OscarCache(compile=False) for the eager one")
        self.max_cache_len_fixed = int(max_cache_len)  # (transformers 5.17's Cache has a read-only max_cache_len)
        super().__init__(model_or_config, rotations, config, compile=True, **overrides)

    @property
    def capacity(self) -> int:
        return self.max_cache_len_fixed

    @classmethod
    def load(cls, directory, model, device=None, *, max_cache_len: int | None = None) -> "StaticOscarCache":
        """Load a cache written by :meth:`save` (from either class) into a fixed capacity of ``max_cache_len`` slots:
        by default the saved StaticOscarCache's own, or the saved length plus headroom; a ``max_cache_len`` smaller
        than the saved length (left padding included) is a ValueError."""
        return load_cache(cls, directory, model, device, compile=True, fixed_capacity=True, max_cache_len=max_cache_len)

    def __repr__(self) -> str:
        return super().__repr__().replace("OscarCache(", f"StaticOscarCache(max_cache_len={self.capacity}, ", 1)
