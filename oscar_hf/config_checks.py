"""The renamed fields of an :class:`~oscar_hf.config.OscarConfig` (their checks: ``OscarConfig.__post_init__``)."""
from __future__ import annotations

import warnings

# old name -> today's. Keywords warn (FutureWarning); saved configs and artifacts load either name.
RENAMED_FIELDS = {"full_precision_heads": "retrieval_heads", "full_precision_bits": "retrieval_bits"}


def renamed_keywords(kw: dict, where: str, warn: bool = True, stacklevel: int = 3) -> dict:
    """``kw`` with old field names renamed (a FutureWarning each when ``warn``); a TypeError when both are given."""
    if not any(old in kw for old in RENAMED_FIELDS):
        return kw
    kw = dict(kw)
    for old, new in RENAMED_FIELDS.items():
        if old in kw:
            if new in kw:
                raise TypeError(f"{where}: pass {new}= only ({old}= is its old name), not both")
            if warn:
                warnings.warn(f"{where}: {old}= is now {new}= (the retrieval heads); the old name will be removed",
                              FutureWarning, stacklevel=stacklevel)
            kw[new] = kw.pop(old)
    return kw
