"""The reference text a long-generation evaluation reads: the plain model's own continuation of each prompt.

Greedy, or sampled (:class:`Sampling`: a fixed seed per prompt, so a run is reproducible; a small model's greedy text
loops, a sampled one does not, and :func:`distinct_ngrams` measures how much a continuation repeats). Prompts are
token windows of held-out text, or (:func:`chat_prompts`) an instruction about each window through the model's chat
template. The tokens that would end the text (:func:`stop_ids`) are never chosen, so every position continues it.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from .perplexity import decode_logits

# --chat: one instruction per prompt (in turn), each followed by a held-out text window; they ask for long answers
INSTRUCTIONS = (
    "Continue the following article in the same style, at length, adding new sections.",
    "Write a detailed essay on the background of the following text and on what might happen next.",
    "Summarize the following passage, then write a long story inspired by it.",
    "Write a long, well-organized report on the topic of this text, with several sections.",
)
# Gemma 3's turn format (its GGUF carries no chat template): user and model turns, the model's turn opened
GEMMA3_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
                        "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] | trim }}"
                        "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


@dataclass(frozen=True)
class Sampling:
    """Sampled continuations: temperature, then top-k, then nucleus (top-p); prompt ``i`` draws from a generator
    seeded with ``seed + i``, so a run is reproducible and every method reads the same continuation."""

    temperature: float = 0.8
    top_k: int = 64
    top_p: float = 0.95
    seed: int = 0

    def __post_init__(self):
        if not (self.temperature > 0 and self.top_k >= 1 and 0 < self.top_p <= 1):
            raise ValueError(f"sampling needs temperature > 0, top_k >= 1, 0 < top_p <= 1; got {self}")

    def draw(self, logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """``[B]`` token ids drawn from ``logits`` ``[B, V]`` (float32; -inf where banned)."""
        logits = logits / self.temperature
        kth = logits.topk(min(self.top_k, logits.shape[-1]), -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
        p, order = F.softmax(logits, -1).sort(-1, descending=True)
        drop = p.cumsum(-1) - p >= self.top_p  # the tokens after the nucleus (the most likely one always stays)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), -math.inf)  # back in vocab order
        return torch.multinomial(F.softmax(logits, -1).cpu(), 1, generator=generator)[:, 0].to(logits.device)


def chat_prompts(tokenizer, windows: torch.Tensor) -> list[torch.Tensor]:
    """``[L_i]`` ids per window of ``windows`` ``[P, L]``: a user turn (an instruction of :data:`INSTRUCTIONS`, then the
    window's text) through the tokenizer's chat template, the assistant's turn opened."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("--chat needs a tokenizer with a chat template")
    return [torch.tensor(tokenizer.apply_chat_template(
        [{"role": "user", "content": INSTRUCTIONS[i % len(INSTRUCTIONS)] + "\n\n" + tokenizer.decode(w)}],
        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]) for i, w in enumerate(windows)]


def stop_ids(model, tokenizer=None) -> list[int]:
    """Ids that would end the text: the model's end-of-sequence ids, and with a ``tokenizer`` that has a chat
    template its EOS and the token that closes an assistant turn (Gemma's ``<end_of_turn>``)."""
    eos = model.generation_config.eos_token_id
    ids = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
    if getattr(tokenizer, "chat_template", None) is not None:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                                             tokenize=False)
        ids |= {tokenizer.eos_token_id, tokenizer(text[text.rindex("b") + 1:], add_special_tokens=False)["input_ids"][0]}
    return sorted(i for i in ids if i is not None)


def continuation(model, prompts, n_tokens: int, sampling: Sampling | None = None, banned: Sequence[int] | None = None,
                 progress: bool = True) -> list[torch.Tensor]:
    """``[L_i + n_tokens]`` per prompt of ``prompts`` (``[P, L]`` or a list of ``[L_i]``): the prompt and the plain
    model's continuation (``DynamicCache``), greedy or sampled (``sampling``). ``banned`` (default: the model's EOS ids)
    are never chosen (as ``generate(min_new_tokens=n_tokens)``), so every position continues the text."""
    if n_tokens <= 0:
        raise ValueError(f"n_tokens must be > 0, got {n_tokens}")
    banned = stop_ids(model) if banned is None else list(banned)
    out = []
    for i, prompt in enumerate(prompts):
        g = torch.Generator().manual_seed(sampling.seed + i) if sampling else None
        L = prompt.shape[0]
        ids = torch.cat([prompt, prompt.new_zeros(n_tokens)])[None].to(next(model.parameters()).device)
        steps = decode_logits(model, ids, L, DynamicCache(config=model.config), progress, "reference")
        for t, logits in zip(range(L, L + n_tokens), steps):
            logits = logits.float()
            logits[:, banned] = -math.inf
            ids[:, t] = sampling.draw(logits, g) if sampling else logits.argmax(-1)  # decode_logits feeds it next
        out.append(ids[0].cpu())
    return out


def distinct_ngrams(ids: torch.Tensor, n: int = 4) -> float:
    """Share of distinct ``n``-grams among the ``n``-grams of ``ids`` ``[N]``: near 1 for text that does not repeat,
    low for a loop."""
    grams = [tuple(x) for x in ids.unfold(0, n, 1).tolist()]
    return len(set(grams)) / len(grams)
