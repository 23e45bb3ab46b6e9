"""The package's layout as the README states it: no import cycle among kimi_hf's modules (module-level and lazy
imports alike), and data flowing one way: ops <- model folders (kimi_hybrid <- kimi_k3) <- the rest; model folders
import nothing of the package but each other, the ops and atomic_io (they are copied into Hub folders)."""

import ast
from pathlib import Path

import kimi_hf


ROOT = Path(kimi_hf.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def resolve(name: str) -> str | None:
    """The kimi_hf module that `import name` / `from name import x` loads (a package's __init__ included)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> set[str]:
    """The kimi_hf modules `module` imports anywhere in its source (functions included)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = (base + "." + node.module if node.module else base) if node.level else node.module
            names = [target] + [f"{target}.{a.name}" for a in node.names]  # `from pkg import submodule`
        else:
            continue
        for name in names:
            if name.startswith("kimi_hf") and (hit := resolve(name)) not in (None, module):
                found.add(hit)
    return found


GRAPH = {m: imports(m) for m in MODULES}


def test_no_import_cycles():
    """Tarjan's strongly connected components of the import graph: each must be a single module. The package's
    own __init__ (which imports the models to register them) and the lazy `kimi_hf.X` lookups it serves are left
    out: importing a submodule runs the package __init__ first anyway."""
    graph = {m: {d for d in deps if d != "kimi_hf"} for m, deps in GRAPH.items() if m != "kimi_hf"}
    index, low, stack, on, cycles = {}, {}, [], set(), []

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
            component = set()
            while True:
                w = stack.pop()
                on.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == []


def test_data_flows_one_way():
    def under(module, *prefixes):
        return any(module == p or module.startswith(p + ".") for p in prefixes)

    for module, deps in GRAPH.items():
        if under(module, "kimi_hf.ops"):  # the ops, and the standard-library leaf of the MX block size
            assert all(under(d, "kimi_hf.ops", "kimi_hf.mx_block") for d in deps), (module, deps)
        if under(module, "kimi_hf.models"):  # Hub-copyable: the model folders, the ops, the stdlib leaves only
            allowed = ("kimi_hf.models", "kimi_hf.ops", "kimi_hf.atomic_io", "kimi_hf.mx_block")
            assert all(under(d, *allowed) for d in deps), (module, sorted(deps))
        if under(module, "kimi_hf.models.kimi_hybrid"):
            assert not any(under(d, "kimi_hf.models.kimi_k3") for d in deps), (module, sorted(deps))
    # the graph is real: the K3 model imports the hybrid layers and the ops through them
    assert "kimi_hf.models.kimi_hybrid.modeling_kimi_hybrid" in GRAPH["kimi_hf.models.kimi_k3.modeling_kimi_k3"]
    assert "kimi_hf.ops.kda" in GRAPH["kimi_hf.models.kimi_hybrid.modeling_kimi_hybrid"]


def test_modules_that_moved_stay_importable_under_their_old_names():
    import importlib
    import sys
    import warnings

    import kimi_hf.models.kimi_k3.modeling_kimi_k3 as k3
    import kimi_hf.ops.kda as kda
    import kimi_hf.ops.mxfp4 as mxfp4

    for old, new in (
        ("kimi_hf.models.kimi_hybrid.kda", kda),
        ("kimi_hf.models.kimi_hybrid.modeling_kimi_k3", k3),
        ("kimi_hf.models.kimi_hybrid.mxfp4_kimi_hybrid", mxfp4),
        ("kimi_hf.models.kimi_k3.mxfp4_kimi_k3", mxfp4),
    ):
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert importlib.import_module(old) is new
        assert any(issubclass(w.category, DeprecationWarning) and new.__name__ in str(w.message) for w in caught)
    from kimi_hf.models.kimi_hybrid.modeling_kimi_k3 import KimiK3ForConditionalGeneration

    assert KimiK3ForConditionalGeneration is kimi_hf.KimiK3ForConditionalGeneration
