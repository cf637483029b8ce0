"""Tiny random models of many architectures: the suite's fixtures (imported as a plain module, like batch_utils:
pytest puts tests/ on sys.path through tests/conftest.py; scripts run directly insert tests/ themselves)."""
import torch


_MLA = dict(num_key_value_heads=4, head_dim=None, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
            qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
            moe_intermediate_size=32, n_group=1, topk_group=1)
_MAMBA2 = dict(mamba_n_heads=8, mamba_d_state=16, mamba_chunk_size=16)
_PER_LAYER_INPUT = dict(hidden_size_per_layer_input=16, vocab_size_per_layer_input=256)


def tiny_config(model_type: str, **overrides):
    """A small random-initialisable config of ``model_type`` (Llama, Qwen2/3, Mistral, Gemma 2/3/3n/4, Phi-3, the
    hybrids, MLA models, ...; tests/test_model_matrix.py runs each)."""
    from transformers import AutoConfig
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096, head_dim=32)
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
                        layer_types=["sliding_attention", "full_attention"])}  # others (Llama, Qwen2/3): the base
    kw = {**base, **per_type.get(model_type, {}), **overrides}
    kw = {k: v for k, v in kw.items() if v is not None or k in ("sliding_window", "attn_logit_softcapping", "final_logit_softcapping")}
    return AutoConfig.for_model(model_type, **kw)


def tiny_model(model_type: str, seed: int = 0, dtype=torch.float32, attn_implementation=None, **overrides):
    from transformers import AutoModelForCausalLM
    if attn_implementation is None:  # Gemma 2 and gpt-oss support eager only (SDPA has no soft-capping / sinks)
        attn_implementation = "eager" if model_type in ("gemma2", "gpt_oss") else "sdpa"
    cfg = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn_implementation).eval()
