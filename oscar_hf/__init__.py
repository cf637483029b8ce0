"""oscar-hf: OSCAR 2-bit KV-cache quantization as a drop-in Cache for Hugging Face Transformers.

Data flow: ``calibration`` -> ``rotations`` (artifact) -> ``cache`` (write path) -> ``attention`` (read path).

    from oscar_hf import OscarCache
    cache = OscarCache.from_pretrained("rotations_dir", model)   # or OscarCache(model, method="hadamard")
    model.generate(**inputs, cache=cache)   # Transformers without `cache=` (e.g. 5.17): past_key_values=cache
    # a fixed capacity: StaticOscarCache.from_pretrained("rotations_dir", model, max_cache_len=N)
"""
import logging

from .attention import disable_oscar, enable_oscar
from .cache import OscarCache, StaticOscarCache
from .calibration import calibrate, find_retrieval_heads
from .config import OscarConfig
from .rotations import OscarRotations
from .version import __version__

logging.getLogger("oscar_hf").addHandler(logging.NullHandler())

__all__ = ["OscarCache", "StaticOscarCache", "OscarConfig", "OscarRotations", "calibrate", "find_retrieval_heads",
    "enable_oscar", "disable_oscar", "__version__"]
