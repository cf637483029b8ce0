"""oscar-hf: OSCAR 2-bit KV-cache quantization as a drop-in Cache for Hugging Face Transformers. Data flow:
``calibration`` -> ``rotations`` (artifact) -> ``cache`` (write path) -> ``attention`` (read path); usage: README.md
and docs/usage.md ("The cache in `generate`").
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
