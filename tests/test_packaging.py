"""Installation layout: `kernels/` is `oscar_hf.kernels`, never a top-level `kernels` module."""
import importlib.util
from pathlib import Path

import oscar_hf
import oscar_hf.eval
import oscar_hf.kernels

REPO = Path(__file__).resolve().parent.parent


def test_kernels_installed_under_oscar_hf():
    assert Path(oscar_hf.kernels.__file__).resolve().parent == REPO / "kernels"
    assert Path(oscar_hf.eval.__file__).resolve().parent == REPO / "eval"


def test_no_top_level_kernels_module_shadows_hugging_face():
    spec = importlib.util.find_spec("kernels")
    if spec is not None:  # Hugging Face's `kernels` may be installed; it must not be our directory
        assert REPO / "kernels" not in [Path(p).resolve() for p in (spec.submodule_search_locations or [])]
    from transformers.utils import import_utils

    if spec is None:
        assert not import_utils.is_kernels_available()


def test_every_subpackage_is_installed():
    """A non-editable install ships only the packages setup.cfg lists: every folder of oscar_hf/ with an __init__.py
    must be there."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    found = {"oscar_hf." + ".".join(p.parent.relative_to(REPO / "oscar_hf").parts)
             for p in (REPO / "oscar_hf").rglob("__init__.py") if p.parent != REPO / "oscar_hf"}
    assert found <= listed, f"missing from setup.cfg [options] packages: {sorted(found - listed)}"


PUBLIC_API = ("OscarCache", "StaticOscarCache", "OscarConfig", "OscarRotations", "calibrate", "find_retrieval_heads",
              "enable_oscar", "disable_oscar", "__version__")


def test_public_api():
    assert sorted(oscar_hf.__all__) == sorted(PUBLIC_API)
    for name in PUBLIC_API:
        assert hasattr(oscar_hf, name), name
    assert callable(oscar_hf.calibrate) and callable(oscar_hf.find_retrieval_heads)
    for alias in ("patch_model", "unpatch_model"):  # one name per thing
        assert not hasattr(oscar_hf, alias)


# ---------------------------------------------------------------------------------------------- import graph
# The installed layout (setup.cfg package_dir): package -> folder of the repository.
PACKAGE_DIRS = {"oscar_hf": REPO / "oscar_hf", "oscar_hf.kernels": REPO / "kernels", "oscar_hf.eval": REPO / "eval"}


def package_modules() -> dict[str, Path]:
    """``{dotted module name: file}`` of every module of the installed package (folders per ``PACKAGE_DIRS``)."""
    mods = {}
    for pkg, root in PACKAGE_DIRS.items():
        for f in sorted(root.rglob("*.py")):
            rel = f.relative_to(root).with_suffix("").parts
            if any(p.startswith(".") or p == "__pycache__" for p in rel):
                continue
            name = ".".join((pkg, *rel))
            mods[name.removesuffix(".__init__")] = f
    return mods


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports, module-level and function-level imports alike (every
    ``import`` / ``from ... import`` node of its AST). ``from pkg import name`` counts as an import of the
    submodule ``pkg.name`` when that is a module, else of ``pkg`` itself."""
    import ast

    mods = package_modules()
    graph = {}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:  # `import a.b.c` of a non-module attribute: its closest module
                    t = t.rpartition(".")[0]
                if t and t != name:
                    edges.add(t)
        graph[name] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_import_graph_sees_the_package():
    graph = import_graph()
    assert {"oscar_hf", "oscar_hf.cache.layer", "oscar_hf.kernels.write_path", "oscar_hf.eval.methods"} <= set(graph)
    assert "oscar_hf.kernels.static_op" in graph["oscar_hf.cache.layer"]  # the layer's decode step
    assert "oscar_hf.cache.layer_eager" in graph["oscar_hf.cache.layer"]
    assert "oscar_hf.quant" in graph["oscar_hf.kernels.write_path"]


def test_import_cycle_check_finds_a_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles (module-level and function-level imports): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_import_is_cheap():
    """``import oscar_hf`` loads no Triton kernel module (they load at the first kernel call)."""
    import json
    import subprocess
    import sys

    code = "import json, sys, oscar_hf; print(json.dumps(sorted(m for m in sys.modules if m.startswith('oscar_hf.'))))"
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = json.loads(out)
    assert "oscar_hf.kernels.write_path" in loaded  # (the check sees the kernels package)
    assert not [m for m in loaded if m.endswith(("_triton", "_gluon"))], loaded


if __name__ == "__main__":  # python3 -P tests/test_packaging.py: print the package's import cycles
    for c in import_cycles(import_graph()):
        print(" <-> ".join(c))
