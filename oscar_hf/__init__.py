"""oscar-hf: OSCAR 2-bit KV-cache quantization as a drop-in Cache for Hugging Face Transformers.

Data flow: ``calibration`` -> ``rotations`` (artifact) -> ``cache`` (write path) -> ``attention`` (read path).
"""
import logging

from .config import ModelFingerprint, OscarConfig
from .rotations import LayerRotation, OscarRotations

logging.getLogger("oscar_hf").addHandler(logging.NullHandler())

__version__ = "0.1.0"
__all__ = ["OscarConfig", "ModelFingerprint", "OscarRotations", "LayerRotation"]
