"""oscar-hf: OSCAR 2-bit KV-cache quantization as a drop-in Cache for Hugging Face Transformers.

Data flow: ``calibration`` -> ``rotations`` (artifact) -> ``cache`` (write path) -> ``attention`` (read path).

    cache = OscarCache.from_pretrained("rotations_dir", model)   # or OscarCache(model, method="hadamard")
    model.generate(**inputs, past_key_values=cache)
    # compiled decoding (CUDA graphs): StaticOscarCache.from_pretrained("rotations_dir", model, max_cache_len=N)
"""
import logging

from .config import ModelFingerprint, OscarConfig
from .rotations import LayerRotation, OscarRotations
from .cache import OscarCache, OscarLayer
from .static_cache import StaticOscarCache, StaticOscarLayer
from .attention import disable_oscar, enable_oscar

logging.getLogger("oscar_hf").addHandler(logging.NullHandler())

patch_model = enable_oscar
unpatch_model = disable_oscar

__version__ = "0.1.0"
__all__ = [
    "OscarConfig",
    "ModelFingerprint",
    "OscarRotations",
    "LayerRotation",
    "OscarCache",
    "OscarLayer",
    "StaticOscarCache",
    "StaticOscarLayer",
    "enable_oscar",
    "disable_oscar",
    "patch_model",
    "unpatch_model",
]
