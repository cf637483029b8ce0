"""Human-readable views of a calibration: the text report of an artifact, the plot of its spectra and the plot of its
settings search (KL against bits)."""
from __future__ import annotations

import torch

from ..config import OscarConfig, artifact_settings
from ..layer_choice import resolve_retrieval_heads
from ..rotations import OscarRotations
from .retrieval_heads import top_heads
from .settings import kl_frontier, settings_summary
from .stats import CalibrationStats


def retrieval_summary(rotations: OscarRotations) -> str:
    """One line: the best retrieval heads and their scores, and those ``OscarCache.from_pretrained``'s config keeps
    at what history bits."""
    scores = rotations.retrieval_scores
    if scores is None:
        return "  retrieval heads: not scored (no retrieval heads by default)"
    chosen = artifact_settings(rotations.metadata)
    if chosen:  # the settings the calibration chose (what the cache starts from)
        config = OscarConfig(**chosen)
    else:
        g = (rotations.metadata.get("calibration") or {}).get("group_size", rotations.metadata.get("group_size"))
        config = OscarConfig(group_size=int(g)) if g is not None else OscarConfig()
    config = config.for_head_dim(rotations.fingerprint.head_dim)
    fp = rotations.fingerprint
    heads = resolve_retrieval_heads(config, rotations, fp, config.skipped(fp.num_layers))
    n = sum(map(len, heads.values()))
    share = n / max(1, len(rotations.layers) * fp.num_key_value_heads)
    form = "in the model dtype" if config.retrieval_bits == 16 else f"as INT{config.retrieval_bits}"
    best = ", ".join(f"{i}:{h} {float(scores[i, h]):.2f}" for i, h in top_heads(scores, 10))
    return (f"  retrieval heads (layer:kv_head score): {best}; retrieval_heads={config.retrieval_heads!r} "
            f"keeps {n} {form} ({sorted((i, h) for i, hs in heads.items() for h in hs)}): "
            f"{config.history_bits(fp.head_dim, share):.2f} history bits per element")


def calibration_report(rotations: OscarRotations) -> str:
    """Human-readable summary of a calibrated artifact (settings, per-layer clips, spectra, winners)."""
    fp, md = rotations.fingerprint, rotations.metadata
    cal = md.get("calibration", {})
    lines = [
        f"OSCAR calibration report: method={rotations.method}  model={fp.name_or_path or fp.architecture}",
        f"  {fp.architecture} ({fp.model_type}): {fp.num_layers} layers, {len(rotations.layers)} quantized "
        f"(full attention), {fp.num_attention_heads} q / {fp.num_key_value_heads} kv heads, head_dim {fp.head_dim}"]
    if cal:
        lines += [
            f"  tokens: {cal.get('tokens')} statistics ({cal.get('windows')} x {cal.get('seq_len')}) + "
            f"{cal.get('holdout_tokens')} held-out; group_size={cal.get('group_size')}, meta={cal.get('meta_dtype')}, "
            f"center={cal.get('center')}, value_target={cal.get('value_target')}, "
            f"window(sink, recent)={cal.get('window')}",
            f"  time: {cal.get('time_s')} s (statistics {cal.get('time_statistics_s')} s, selection "
            f"{cal.get('time_selection_s')} s, KL check {cal.get('time_kl_selection_s', 0)} s, retrieval probes "
            f"{cal.get('time_retrieval_s', 0)} s, settings search {cal.get('time_settings_s', 0)} s); "
            f"passes: {', '.join(cal.get('passes', []))}"]
    lines.append(retrieval_summary(rotations))
    held = md.get("heldout_error", {})
    if held:
        mean = lambda key: sum(h.get(key, float("nan")) for h in held.values()) / len(held)  # noqa: E731
        line = f"  held-out relative error (mean over layers): keys {mean('k_rel'):.4g}, values {mean('v_rel'):.4g}"
        if all("k_rel_identity" in h for h in held.values()):
            line += f"  (identity / no clip: keys {mean('k_rel_identity'):.4g}, values {mean('v_rel_identity'):.4g})"
        lines.append(line)
    if sel := md.get("selection"):
        kl = ", ".join(f"{k} {v:.4g}" + (" (kept)" if k == sel["chosen"] else "") for k, v in sel["kl"].items())
        lines.append(f"  end-to-end check, next-token KL on held-out tokens (per-head pick 'auto' against one "
                     f"candidate everywhere): {kl}")
    if isinstance(md.get("settings"), dict):
        if "chosen" in md["settings"]:
            lines += settings_summary(md["settings"])
        elif "skipped" in md["settings"]:
            lines.append(f"  cache settings not searched: {md['settings']['skipped']}")
    if "auto_counts" in md:
        for kind, name in (("k", "keys"), ("v", "values")):
            cnt = md["auto_counts"].get(kind, {})
            lines.append(
                f"  auto winners ({name}, per layer x kv head): " + ", ".join(f"{k} {v}" for k, v in cnt.items()))
    if rotations.layers:  # per kind, over the layers in order: mean [min, max]
        ck, cv = zip(*((lr.clip_k, lr.clip_v) for _, lr in sorted(rotations.layers.items())))
        lines.append("  clips: " + ", ".join(f"c_{n} mean {sum(c) / len(c):.3f} [{min(c):.2f}, {max(c):.2f}]"
                                             for n, c in (("K", ck), ("V", cv))))
    spectra, winners = md.get("spectra", {}), md.get("winners", {})
    lines += ["", f"{'layer':>5} {'c_K':>5} {'c_V':>5} {'k_rel':>9} {'v_rel':>9}  {'C_Q top/erank':>14} "
              f"{'C_K top/erank':>14} {'C_S top/erank':>14}  rotation k | v (per kv head)"]
    for i, lr in sorted(rotations.layers.items()):
        h = held.get(str(i), {})
        sp = spectra.get(str(i), {})

        def summ(name, sp=sp):  # a spectrum's top share / effective rank, each the mean over KV heads
            s = sp.get(name)
            mean = lambda key: sum(s[key]) / len(s[key])  # noqa: E731
            return f"{mean('top_share'):>7.3f}/{mean('eff_rank'):<6.1f}" if s else f"{'-':>14}"

        wk, wv = (",".join(winners.get(kind, {}).get(str(i), [])) for kind in "kv")
        lines.append(
            f"{i:>5} {lr.clip_k:>5.2f} {lr.clip_v:>5.2f} {h.get('k_rel', float('nan')):>9.4g} "
            f"{h.get('v_rel', float('nan')):>9.4g}  {summ('C_Q')} {summ('C_K')} {summ('C_S')}  {wk} | {wv}")
    return "\n".join(lines) + "\n"


def plot_spectra(obj: CalibrationStats | OscarRotations, path) -> None:
    """PNG of the normalized eigen-spectra of ``C_Q`` vs ``C_K`` per layer and the top-eigenvalue share per layer."""
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    if isinstance(obj, CalibrationStats):
        spectra = {str(i): v for i, v in obj.spectra().items()}
    elif isinstance(obj, OscarRotations):
        spectra = obj.metadata.get("spectra")
        if not spectra:
            raise ValueError("this artifact has no spectra in its metadata (not produced by calibrate())")
    else:
        raise TypeError(f"plot_spectra takes CalibrationStats or OscarRotations, got {type(obj).__name__}")
    layer_ids = sorted(spectra, key=int)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), constrained_layout=True)
    cmap = plt.get_cmap("viridis")
    for ax, name in zip(axes[:2], ("C_Q", "C_K")):
        for n, li in enumerate(layer_ids):
            ev = torch.tensor(spectra[li][name]["eigvals"], dtype=torch.float64).mean(0)
            color = cmap(n / max(len(layer_ids) - 1, 1))
            ax.semilogy(range(1, ev.numel() + 1), ev.clamp_min(1e-12).numpy(), color=color, lw=1)
        ax.set(title=f"{name} eigen-spectrum", xlabel="eigenvalue index", ylabel="share of trace")
        ax.grid(alpha=0.3)
    x = [int(li) for li in layer_ids]
    for name in ("C_Q", "C_K", "C_S", "C_V"):
        if all(name in spectra[li] for li in layer_ids):
            y = [sum(spectra[li][name]["top_share"]) / len(spectra[li][name]["top_share"]) for li in layer_ids]
            axes[2].plot(x, y, marker="o", ms=3, label=name)
    axes[2].set(title="top-eigenvalue share per layer", xlabel="layer")
    axes[2].legend()
    axes[2].grid(alpha=0.3)
    fig.colorbar(plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(min(x), max(x))), ax=axes[1], label="layer")
    fig.suptitle("normalized eigenvalues (share of the trace), mean over KV heads")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_settings(rotations: OscarRotations, path) -> None:
    """PNG of an artifact's settings search: each setting's KL against its bits, the frontier, the budget, the
    chosen setting, and those over the budget (on the bits axis)."""
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    entry = rotations.metadata.get("settings") if isinstance(rotations, OscarRotations) else None
    if not isinstance(entry, dict) or not entry.get("tried"):
        raise ValueError("this artifact records no settings search (calibrate(..., choose_settings=True) makes one)")
    tried, front = entry["tried"], kl_frontier(entry["tried"])
    fig, ax = plt.subplots(figsize=(7.5, 4.8), constrained_layout=True)
    ax.scatter([t["bits"] for t in tried], [t["kl"] for t in tried], s=24, color="tab:blue", label="scored")
    ax.plot([t["bits"] for t in front], [t["kl"] for t in front], color="tab:blue", lw=1, label="frontier")
    for i, t in enumerate(tried):  # (labels above and below in turn: settings often share a point)
        ax.annotate(t["name"], (t["bits"], t["kl"]), fontsize=7, xytext=(4, 4 if i % 2 else -10),
                    textcoords="offset points")
    chosen = next((t for t in tried if t["name"] == entry.get("chosen_name")), None)
    if chosen is not None:
        ax.scatter([chosen["bits"]], [chosen["kl"]], s=90, facecolors="none", edgecolors="tab:red", lw=1.5,
                   label=f"chosen: {chosen['name']}")
    over = entry.get("over_budget") or []
    if over:
        ax.scatter([o["bits"] for o in over], [0.0] * len(over), marker="x", color="tab:gray", clip_on=False,
                   transform=ax.get_xaxis_transform(), label="over the budget (not scored)")
    ax.axvline(entry["budget_bits"], color="tab:red", ls="--", lw=1, label=f"budget {entry['budget_bits']} bits")
    xs = [t["bits"] for t in tried] + [o["bits"] for o in over] + [entry["budget_bits"]]
    ax.set(xlim=(min(xs) - 0.1, max(xs) + 0.1), ylabel="held-out next-token KL",
           xlabel=f"stored bits per cached K/V element at {entry['target_context']} tokens",
           title=f"settings search ({entry.get('time_s', '?')} s): KL against bits")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)
