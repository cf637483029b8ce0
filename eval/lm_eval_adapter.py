"""lm-eval (0.4.13) adapter: ``--model oscar`` = Hugging Face model + an OSCAR-family KV cache.

    python -m oscar_hf.eval.lm_eval_adapter --model oscar \\
        --model_args pretrained=smollm2,method=oscar,rotations=artifacts/smollm2-oscar,sink=64,recent=256,group_size=64 \\
        --tasks wikitext_local --include_path eval/tasks --limit 4

or from Python: ``lm_eval.simple_evaluate(model=OscarLM(pretrained="smollm2", method="hadamard"), tasks=[...])``.

lm-eval has no plugin scan, so this module registers ``oscar`` when imported and its ``__main__``
hands over to lm-eval's own CLI.

What the cache changes, per request type:

* ``loglikelihood`` / ``loglikelihood_rolling`` (``_model_call``, right-padded batches): OscarCache's
  prefill is exact, so one forward through it would score the full-precision model. Every position is
  instead scored as a decode step of the cache, with the one-forward fake-quant path proven equal to
  token-by-token decoding (:mod:`oscar_hf.eval.fakequant`; ``score_mode="decode"``, the default).
  ``score_mode="prefill"`` runs the forward through a fresh cache (exact, like deployment on a prompt).
* ``generate_until`` (``_model_generate``): ``model.generate`` with a fresh cache per call. The prompt's prefill is
  exact, so the question at its end is read in full precision; ``question_decode_tokens=N`` writes all but the
  prompt's last ``N`` tokens first and lets ``generate`` read those ``N`` as a second forward through the cache,
  which attends to the quantized history (stricter: the question itself reads the INT2 history).

``pretrained=smollm2`` / ``pretrained=gemma3-270m`` load the packaged SmolLM2-135M / Gemma-3-270M through
:func:`oscar_hf.eval.models.load_model` (Gemma's tokenizer rebuilt from its GGUF, which lm-eval's own GGUF path would get
wrong: no merges, no ``<bos>``), in ``dtype`` (default float32).
``method``: ``fp`` (DynamicCache), ``identity``, ``hadamard`` (no artifact) or ``oscar`` / ``pca-kv`` /
any calibrated method (``rotations=DIR``).
"""
from __future__ import annotations

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from oscar_hf.compat import cache_kwargs
from oscar_hf.eval.models import DEFAULT_MODEL, GEMMA3, load_model

from .fakequant import fake_quant
from .methods import OscarFamily, get_method


def _bool(x) -> bool:
    return x if isinstance(x, bool) else str(x).lower() in ("1", "true", "yes")


_CONVERT = {"sink": int, "recent": int, "group_size": int, "quantizer": str, "clip_k": float, "clip_v": float}


def _cache_settings(kwargs: dict) -> dict:
    """The OscarConfig keywords among lm-eval's model args (popped from ``kwargs``: the rest go to ``HFLM``), as their
    types (lm-eval passes strings); unset ones: the artifact's chosen settings, else OscarConfig's defaults."""
    cfg = dict(center=_bool(kwargs.pop("center", True)))
    for name, kind in _CONVERT.items():
        value = kwargs.pop(name, None)
        if value is not None:
            cfg[name] = kind(value)
    return cfg


@register_model("oscar")
class OscarLM(HFLM):
    """lm-eval's model ``oscar``: ``method`` / ``rotations`` / the cache settings (``sink``, ``recent``,
    ``group_size``, ``center``, ``clip_k``, ``clip_v``, ``quantizer``) / ``score_mode`` / ``question_decode_tokens`` as
    model args; the others are ``HFLM``'s."""

    def __init__(self, pretrained: str = DEFAULT_MODEL, method: str = "oscar", rotations: str | None = None,
                 score_mode: str = "decode", question_decode_tokens: int = 0, gguf_file: str | None = None, **kwargs):
        if score_mode not in ("decode", "prefill"):
            raise ValueError(f"score_mode must be 'decode' or 'prefill', got {score_mode!r}")
        if int(question_decode_tokens) < 0:
            raise ValueError(f"question_decode_tokens must be >= 0, got {question_decode_tokens!r}")
        cfg = _cache_settings(kwargs)
        kwargs.setdefault("dtype", "float32")
        if pretrained in (DEFAULT_MODEL, GEMMA3):  # a packaged model: its (model, tokenizer) as objects
            if gguf_file is not None:
                raise ValueError(f"pretrained={pretrained!r} is a packaged model: gguf_file is not taken with it")
            pretrained, tok = load_model(pretrained, dtype=kwargs.pop("dtype"))
            kwargs.setdefault("tokenizer", tok)
        super().__init__(pretrained=pretrained, gguf_file=gguf_file, **kwargs)
        if method == "fp":
            self.kv_method = get_method("fp")
        elif rotations:
            from oscar_hf import OscarRotations

            self.kv_method = OscarFamily(method, rotations=OscarRotations.from_pretrained(rotations), **cfg)
        elif method in ("identity", "hadamard"):
            self.kv_method = get_method(method, **cfg)
        else:
            raise ValueError(f"method={method!r} needs rotations=<artifact dir> (artifact-free: fp, identity, hadamard)")
        self.question_decode_tokens = int(question_decode_tokens)
        used = getattr(self.kv_method, "config", None)  # the settings the cache gets (chosen ones included)
        if used is not None:
            cfg = {k: getattr(used, k) for k in ("sink", "recent", "group_size", "center", "quantizer")}
        self.oscar_settings = dict(method=method, rotations=rotations, score_mode=score_mode,
                                   question_decode_tokens=self.question_decode_tokens, **cfg)
        self.score_mode = score_mode
        self._spec = self.kv_method.fake_spec(self.model)

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        with torch.no_grad():
            if self.score_mode == "decode":
                with fake_quant(self.model, self._spec, prefill_len=1):
                    return self.model(inps, use_cache=False).logits
            cache = self.kv_method.make_cache(self.model)  # fresh per call
            return self.model(inps, **cache_kwargs(self.model, cache), use_cache=True).logits

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        cache = self.kv_method.make_cache(self.model)  # fresh per call
        n = self.question_decode_tokens
        if 0 < n < context.shape[1]:
            # context [B, L] (left-padded): its first L - n tokens written by one forward; generate then feeds the
            # last n (the cache holds the rest) as one forward that reads the quantized history
            mask = generation_kwargs.get("attention_mask")
            with torch.no_grad():
                self.model(context[:, :-n], attention_mask=None if mask is None else mask[:, :-n],
                           **cache_kwargs(self.model, cache), use_cache=True, logits_to_keep=1)
        generation_kwargs.update(cache_kwargs(self.model, cache))
        generation_kwargs.pop("use_cache", None)
        return super()._model_generate(context, max_length, stop, **generation_kwargs)

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        info["oscar"] = dict(self.oscar_settings, kv_method=type(self.kv_method).__name__,
                             bits_per_element_at_2048=self.kv_method.bits(2048, self.model.config.head_dim
                                                                          if getattr(self.model.config, "head_dim", None)
                                                                          else self.model.config.hidden_size // self.model.config.num_attention_heads))
        return info


def cli() -> None:
    """Console entry: lm-eval's own CLI with ``--model oscar`` registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    cli()
