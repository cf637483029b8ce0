"""Helpers shared by the generate tests (imported as a plain module: pytest puts tests/ on sys.path)."""
import torch
from transformers import CompileConfig


def cpu_compile_config():
    """``generate``'s compile route on the CPU (fullgraph, eager backend): checks the compiled storage without a GPU."""
    cc = CompileConfig(fullgraph=True, backend="eager", mode=None)
    cc._compile_all_devices = True
    return cc


def left_pad(prompts):
    """``(ids, attention_mask)`` ``[B, T]``: the 1-D ``prompts`` right-aligned, left padding 0 (masked)."""
    t = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), t, dtype=torch.long)
    am = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, t - len(p) :], am[i, t - len(p) :] = p, 1
    return ids, am


def cuda_qwen3(seed: int = 0):
    """A small bf16 Qwen3 on CUDA with the production head shape (32 query / 8 KV heads, head_dim 128), for the GPU
    tests of the compiled storage."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3", hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=1000,
                               max_position_embeddings=8192)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").eval()


def random_left_padded(lens, seed: int = 5):
    """``(ids, attention_mask)``: random token ids (1..199), row ``i`` with ``lens[i]`` real tokens, left-padded."""
    torch.manual_seed(seed)
    return left_pad([torch.randint(1, 200, (n,)) for n in lens])


