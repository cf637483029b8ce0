"""The Transformers API we build on: the cache argument's name (``cache=`` / ``past_key_values=``), the base
``Cache`` / layer signatures our classes implement or call, and Transformers' global layer mapping.

Passes on Transformers 5.17 (the GPU machine) through 5.24; a contract test fails when the installed version
drifts from what ``oscar_hf/cache`` relies on, and each contract check is shown to fail on a faked drift."""
from __future__ import annotations

import ast
import gc
import inspect
import warnings
from pathlib import Path

import pytest
import torch
from transformers import cache_utils
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer, StaticLayer
from transformers.cache_utils import (
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionAndStaticSlidingWindowAttentionLayer,
    LinearAttentionLayer,
    StaticSlidingWindowLayer,
)

import oscar_hf
from oscar_hf import OscarCache, StaticOscarCache
from oscar_hf.cache import GrowingLayer, OscarHybridLayer, OscarLayer
from oscar_hf.cache.base import QuantizedLayerBase
from oscar_hf.compat import CACHE_ARGUMENTS, cache_argument, cache_kwargs, returned_cache

from tiny_models import tiny_model

REPO = Path(__file__).resolve().parent.parent
SMALL = dict(method="hadamard", sink=4, recent=8, group_size=32)  # tiny llama: head_dim 32; quantizes after 12 tokens
OLD_NAME = "past_key_values"


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


# ---------------------------------------------------------------------------------------------- cache argument
def test_cache_argument_is_the_forward_parameter(llama):
    params = inspect.signature(type(llama).forward).parameters
    name = cache_argument(llama)
    assert name in CACHE_ARGUMENTS and name in params
    if "cache" in params:  # the newest name wins wherever the forward has it
        assert name == "cache"
    assert cache_argument(type(llama)) == name and cache_argument(torch.compile(llama)) == name
    c = object()
    assert cache_kwargs(llama, c) == {name: c}


def test_cache_argument_of_a_kwargs_only_wrapper_is_what_generate_uses():
    from transformers.generation.utils import GenerationMixin

    class Wrapper(torch.nn.Module):  # e.g. a PEFT model: forward(*args, **kwargs)
        def forward(self, *args, **kwargs):
            return None

    declared = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    want = next(n for n in CACHE_ARGUMENTS if n in declared)
    assert cache_argument(Wrapper()) == want


def test_returned_cache_reads_either_name(llama):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    c = OscarCache(llama, **SMALL)
    out = llama(torch.randint(1, 200, (1, 10)), **cache_kwargs(llama, c), use_cache=True)
    assert returned_cache(out) is c
    assert returned_cache(llama(torch.randint(1, 200, (1, 4)), use_cache=False)) is None
    # a ModelOutput-like mapping of either generation of Transformers
    assert returned_cache({OLD_NAME: c}) is c and returned_cache({"cache": c}) is c
    assert returned_cache(CausalLMOutputWithPast(logits=torch.zeros(1))) is None
    with pytest.raises(ValueError, match="return_dict_in_generate"):
        returned_cache(torch.zeros(1, 3))


def _stub_tokenizer():
    class Tok:
        eos_token_id = None

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    return Tok()


def test_no_deprecation_warning_from_our_calls(llama):
    """generate, forward loops and the eval helpers with our caches, every FutureWarning an error: fails on
    Transformers with ``cache=`` when one of these call sites passes ``past_key_values=``."""
    from oscar_hf.eval.needle import answer
    from oscar_hf.eval.perplexity import cache_nll

    torch.manual_seed(0)
    ids = torch.randint(1, 200, (2, 20))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        cache = OscarCache(llama, **SMALL)
        out = llama.generate(ids, **cache_kwargs(llama, cache), max_new_tokens=4, do_sample=False, pad_token_id=0,
                             return_dict_in_generate=True)
        assert returned_cache(out) is cache and cache.get_seq_length() == 23
        static = StaticOscarCache(llama, max_cache_len=30, **SMALL)
        seq = llama.generate(ids, **cache_kwargs(llama, static), max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(seq, out.sequences)
        cache = OscarCache(llama, **SMALL)
        step = llama(ids, **cache_kwargs(llama, cache), use_cache=True)
        step = llama(step.logits[:, -1:].argmax(-1), **cache_kwargs(llama, returned_cache(step)), use_cache=True)
        assert returned_cache(step) is cache and cache.get_seq_length() == 21
        res = cache_nll(llama, ids[:1], 16, lambda: OscarCache(llama, **SMALL), progress=False)
        assert res["tokens"] == 4 and isinstance(res["cache"], OscarCache)
        assert answer(llama, _stub_tokenizer(), ids[0, :14], ids[0, 14:16], lambda: OscarCache(llama, **SMALL),
                      max_new_tokens=2)


def test_the_warning_check_can_fail(llama):
    """Where the forward takes ``cache=``, passing the old name warns: what the test above turns into an error."""
    if cache_argument(llama) != "cache":
        pytest.skip("this Transformers takes past_key_values= only: nothing is deprecated")
    ids = torch.randint(1, 200, (1, 8))
    with pytest.warns(FutureWarning, match=OLD_NAME):
        llama(ids, **{OLD_NAME: OscarCache(llama, **SMALL)}, use_cache=True)
    with pytest.warns(FutureWarning, match=OLD_NAME):
        llama.generate(ids, **{OLD_NAME: OscarCache(llama, **SMALL)}, max_new_tokens=1, do_sample=False,
                       pad_token_id=0)


SOURCE_DIRS = ("oscar_hf", "kernels", "eval", "scripts", "benchmarks", "tests")


def deprecated_cache_uses(tree: ast.AST) -> list[int]:
    """Lines that pass or read the cache under its old name literally: ``f(past_key_values=...)``,
    ``{"past_key_values": ...}``, ``x["past_key_values"]``, ``out.past_key_values``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == OLD_NAME:
            lines.append(node.value.lineno)
        elif isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == OLD_NAME for k in node.keys):
            lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == OLD_NAME:
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == OLD_NAME:
            lines.append(node.lineno)
    return sorted(lines)


def test_no_call_site_names_past_key_values():
    """Every call site goes through ``oscar_hf.compat`` (``cache_kwargs`` / ``returned_cache``)."""
    found = []
    for d in SOURCE_DIRS:
        for f in sorted((REPO / d).rglob("*.py")):
            if any(p.startswith(".") or p == "__pycache__" for p in f.relative_to(REPO).parts):
                continue
            found += [f"{f.relative_to(REPO)}:{n}" for n in deprecated_cache_uses(ast.parse(f.read_text(), str(f)))]
    assert not found, f"pass the cache with **oscar_hf.compat.cache_kwargs(model, cache): {found}"


def test_the_call_site_scan_can_fail():
    bad = ("model.generate(ids, past_key_values=c)\n"
           "kw = {'past_key_values': c}\n"
           "kw['past_key_values']\n"
           "out.past_key_values\n")
    assert deprecated_cache_uses(ast.parse(bad)) == [1, 2, 3, 4]
    assert deprecated_cache_uses(ast.parse("model.generate(ids, **cache_kwargs(model, c))\n")) == []


# ---------------------------------------------------------------------------------------------- signatures
# What our caches rely on, as accepted parameter names (``self`` left out; ``*args`` / ``**kwargs`` spelled so).
# Several tuples: the names differ between the versions we support. Layer methods: what our layers implement or
# override and Transformers' Cache calls on them; Cache methods: what generate / the mask builders call on our
# caches, which inherit them; constructors: the layers we build for unquantized layers.
ANY = None
LAYER_CONTRACT = {
    CacheLayerMixin: {
        "lazy_initialization": [("key_states", "value_states")],
        "update": [("key_states", "value_states", "*args", "**kwargs")],
        "get_mask_sizes": [("query_length",)],
        "get_seq_length": [()],
        "get_max_length": [()],
        "reset": [()],
        "reorder_cache": [("beam_idx",)],
        "offload": [()],
        "prefetch": [()],
    },
    DynamicLayer: {
        "crop": [("tokens_to_remove",), ("max_length",)],
        "batch_repeat_interleave": [("repeats",)],
        "batch_select_indices": [("indices",)],
    },
}
CACHE_CONTRACT = {
    "__init__": ANY,  # checked by keyword below: layers=
    "update": [("key_states", "value_states", "layer_idx", "*args", "**kwargs"),
               ("key_states", "value_states", "layer_idx", "cache_kwargs")],
    "get_seq_length": [("layer_idx",)],
    "get_mask_sizes": [("query_length", "layer_idx")],
    "get_max_length": [("layer_idx",)],
    "crop": [("tokens_to_remove",), ("max_length",)],
    "reorder_cache": [("beam_idx",)],
    "batch_repeat_interleave": [("repeats",)],
    "batch_select_indices": [("indices",)],
    "reset": [()],
    "early_initialization": [("batch_size", "num_heads", "head_dim", "dtype", "device")],
    "offload": [("layer_idx", "only_non_sliding")],
    "prefetch": [("layer_idx", "only_non_sliding")],
}
LAYER_ATTRIBUTES = ("is_compileable", "is_croppable", "supports_early_init", "_layer_type")
CACHE_PROPERTIES = ("is_compileable", "is_croppable", "is_sliding", "is_initialized")
CONSTRUCTORS = {  # the unquantized layers OscarCache / StaticOscarCache build, by keyword
    DynamicLayer: (), DynamicSlidingWindowLayer: ("sliding_window",),
    StaticLayer: ("max_cache_len",), StaticSlidingWindowLayer: ("max_cache_len", "sliding_window"),
    LinearAttentionLayer: ("number_of_states",), LinearAttentionAndFullAttentionLayer: ("number_of_states",),
    LinearAttentionAndSlidingWindowAttentionLayer: ("sliding_window", "number_of_states"),
    LinearAttentionAndStaticSlidingWindowAttentionLayer: ("max_cache_len", "sliding_window", "number_of_states"),
}
# every layer class of ours that a cache holds (test_our_layers_do_not_set_layer_type checks that none is missing)
OUR_LAYERS = (OscarLayer, OscarHybridLayer, GrowingLayer)


def param_names(fn) -> tuple[str, ...]:
    """Parameter names of ``fn`` without ``self``, ``*args`` / ``**kwargs`` marked (follows ``__wrapped__``)."""
    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            out.append("*" + p.name)
        elif p.kind is p.VAR_KEYWORD:
            out.append("**" + p.name)
        else:
            out.append(p.name)
    return tuple(out[1:]) if out and out[0] in ("self", "cls") else tuple(out)


def base_problems() -> list[str]:
    """Drift of the installed Transformers from :data:`LAYER_CONTRACT` / :data:`CACHE_CONTRACT`."""
    problems = []
    for cls, methods in LAYER_CONTRACT.items():
        for name, accepted in methods.items():
            fn = getattr(cls, name, None)
            if fn is None:
                problems.append(f"{cls.__name__}.{name} is gone")
            elif param_names(fn) not in accepted:
                problems.append(f"{cls.__name__}.{name}{param_names(fn)} is none of {accepted}")
    for name in LAYER_ATTRIBUTES:
        if not hasattr(CacheLayerMixin, name):
            problems.append(f"CacheLayerMixin.{name} is gone")
    unknown = set(getattr(CacheLayerMixin, "__abstractmethods__", ())) - set(LAYER_CONTRACT[CacheLayerMixin])
    if unknown:
        problems.append(f"CacheLayerMixin has abstract methods our layers do not implement: {sorted(unknown)}")
    for name, accepted in CACHE_CONTRACT.items():
        fn = getattr(Cache, name, None)
        if fn is None:
            problems.append(f"Cache.{name} is gone")
        elif accepted is not ANY and param_names(fn) not in accepted:
            problems.append(f"Cache.{name}{param_names(fn)} is none of {accepted}")
    if "layers" not in param_names(Cache.__init__):
        problems.append(f"Cache.__init__{param_names(Cache.__init__)} takes no layers=")
    for name in CACHE_PROPERTIES:
        if not isinstance(inspect.getattr_static(Cache, name, None), property):
            problems.append(f"Cache.{name} is not a property")
    for cls, kwargs in CONSTRUCTORS.items():
        missing = set(kwargs) - set(param_names(cls.__init__))
        if missing:
            problems.append(f"{cls.__name__}.__init__{param_names(cls.__init__)} lacks {sorted(missing)}")
    return problems


def override_problems() -> list[str]:
    """Methods of our layers that could not be called the way the base declares them (positionally and by name)."""
    problems = []
    for ours in OUR_LAYERS:
        for base, methods in LAYER_CONTRACT.items():
            for name in methods:
                mine = getattr(ours, name, None)
                if mine is None:
                    problems.append(f"{ours.__name__}.{name} is missing")
                    continue
                sig = inspect.signature(mine)
                declared = [n for n in param_names(getattr(base, name)) if not n.startswith("*")]
                try:
                    sig.bind(None, *declared)
                    sig.bind(None, **{n: n for n in declared})
                except TypeError as e:
                    problems.append(f"{ours.__name__}.{name}{param_names(mine)} cannot take {base.__name__}'s "
                                    f"{tuple(declared)}: {e}")
    return problems


def test_base_cache_signatures_are_the_ones_we_rely_on():
    assert base_problems() == []


def test_our_layers_override_with_compatible_signatures():
    assert override_problems() == []
    for ours in OUR_LAYERS:  # instantiable: every abstract method implemented
        assert not getattr(ours, "__abstractmethods__", None), ours


def test_signature_checks_fail_on_a_drift(monkeypatch):
    """Each check reports a faked drift: renamed / extra parameters, a removed method, a new abstract method,
    an override of ours that no longer matches."""
    monkeypatch.setattr(CacheLayerMixin, "get_mask_sizes", lambda self, cache_position, layer_idx: (0, 0))
    monkeypatch.setattr(Cache, "crop", lambda self, max_length, strict: None)
    monkeypatch.delattr(Cache, "early_initialization")
    monkeypatch.setattr(CacheLayerMixin, "__abstractmethods__", frozenset({"get_seq_length", "get_page_table"}))
    monkeypatch.setattr(StaticLayer, "__init__", lambda self, max_len: None)
    problems = "\n".join(base_problems())
    for needle in ("CacheLayerMixin.get_mask_sizes", "Cache.crop", "Cache.early_initialization is gone",
                   "get_page_table", "StaticLayer.__init__"):
        assert needle in problems, (needle, problems)
    monkeypatch.undo()
    assert base_problems() == []

    monkeypatch.setattr(OscarLayer, "reorder_cache", lambda self: None)  # lost its beam_idx
    monkeypatch.setattr(GrowingLayer, "get_mask_sizes", lambda self, query_length, layer_idx: (0, 0))
    problems = "\n".join(override_problems())
    assert "OscarLayer.reorder_cache" in problems and "GrowingLayer.get_mask_sizes" in problems, problems


# ---------------------------------------------------------------------------------------------- layer mapping
def our_layer_classes() -> list[type]:
    """Every subclass of Transformers' layer base defined in the oscar_hf package (imported above)."""
    out, todo = [], list(CacheLayerMixin.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.__module__.split(".")[0] == oscar_hf.__name__:
            out.append(cls)
    return out


def registered_by_us() -> dict[str, type]:
    """Entries of Transformers' global layer-type mappings that point at a class not defined by Transformers."""
    out = {}
    for kind, mapping in (("dynamic", cache_utils.DYNAMIC_LAYER_TYPE_MAPPING),
                          ("static", cache_utils.STATIC_LAYER_TYPE_MAPPING)):
        out.update({f"{kind}:{k}": v for k, v in mapping.items() if not v.__module__.startswith("transformers.")})
    return out


def test_our_layers_do_not_set_layer_type():
    classes = our_layer_classes()
    assert set(classes) == {*OUR_LAYERS, QuantizedLayerBase}  # (their abstract base)
    for cls in classes:  # a _layer_type would register the class for every model's cache (__init_subclass__)
        assert "_layer_type" not in vars(cls) and cls._layer_type is None, cls
    assert registered_by_us() == {}


def test_building_our_caches_leaves_the_global_layer_mapping_unchanged():
    before = (dict(cache_utils.DYNAMIC_LAYER_TYPE_MAPPING), dict(cache_utils.STATIC_LAYER_TYPE_MAPPING))
    for model_type in ("llama", "gemma3_text"):  # gemma3: sliding + full layers
        m = tiny_model(model_type)
        ids = torch.randint(1, 200, (1, 20))
        for cache in (OscarCache(m, **SMALL), StaticOscarCache(m, max_cache_len=24, **SMALL)):
            m.generate(ids, **cache_kwargs(m, cache), max_new_tokens=2, do_sample=False, pad_token_id=0)
        # and a plain Transformers cache for the same model is still built from Transformers' own layers
        from transformers import DynamicCache

        assert all(type(layer).__module__.startswith("transformers.") for layer in DynamicCache(config=m.config).layers)
    assert (dict(cache_utils.DYNAMIC_LAYER_TYPE_MAPPING), dict(cache_utils.STATIC_LAYER_TYPE_MAPPING)) == before
    assert registered_by_us() == {}


def test_the_layer_type_check_can_fail(monkeypatch):
    """A layer class of ours with a ``_layer_type`` lands in the global mapping, which the checks above catch."""
    monkeypatch.setattr(cache_utils, "DYNAMIC_LAYER_TYPE_MAPPING", dict(cache_utils.DYNAMIC_LAYER_TYPE_MAPPING))
    bad = type("RegisteringLayer", (OscarLayer,), {"_layer_type": "full_attention", "__module__": "oscar_hf.cache.x"})
    try:
        assert registered_by_us() == {"dynamic:full_attention": bad}
        assert bad in our_layer_classes() and "_layer_type" in vars(bad)
    finally:
        monkeypatch.undo()
        del bad
        gc.collect()  # drop it from OscarLayer.__subclasses__()
    assert registered_by_us() == {} and not any(c.__name__ == "RegisteringLayer" for c in our_layer_classes())
