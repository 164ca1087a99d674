"""The code stays readable in pieces: no Python file over 500 lines, and imports that only go down.

megatrain's folders form layers (docs/DESIGN.md 3): a module imports modules of its own folder or of a lower
layer, never of a higher one, and the modules inside one folder import each other without a cycle. Every
import statement counts, the ones inside functions (lazy) and under `if TYPE_CHECKING:` too: a lazy import
is a dependency that is only paid for later, and hiding an upward import in a function does not make the
layer below readable without the one above.
"""

import ast
from pathlib import Path

import networkx as nx

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "megatrain"
MAX_LINES = 500

# lowest first; a node is a folder under megatrain/ or a top-level module. Nodes in one layer are independent.
LAYERS = (
    ("megatrain", "files"),  # the version (megatrain/__init__.py exports lazily, by name); reads and writes
    ("models", "vab"),  # configs, presets, unit templates, the eager model; the VAB protocol, no training stack
    ("ir",),  # ModelIR, Program, and the tracer that builds a ModelIR from the models' templates
    ("planner",),  # hardware, passes, cost model, verifier, estimator
    ("codegen",),  # the step program emitted from a plan
    ("runtime",),  # devices, store, engine, trainer, data, checkpoints, the machine probe
    ("plots", "fake_cuda"),  # pictures of plans and runs; the fake CUDA backend, which patches the runtime
    ("cli",),  # the `megatrain` and `megatrain-vab` commands: on top, they may import anything
    ("__main__",),
)


def _python_files(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (REPO / f).rglob("*.py") if "__pycache__" not in p.parts)


def _modules() -> dict[str, Path]:
    """Import name relative to megatrain ("runtime.engine", "files"; "megatrain" for the package itself)."""
    out = {}
    for path in _python_files("megatrain"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts) or "megatrain"] = path
    return out


def _full(name: str) -> str:
    return "megatrain" if name == "megatrain" else f"megatrain.{name}"


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that `name` imports: `from a import b` counts as importing a.b when b is a module,
    else a (a parent package runs first anyway; its own imports are its own edges)."""
    known = {_full(m): m for m in modules}
    package = _full(name) if path.name == "__init__.py" else _full(name).rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {known[a.name] for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            for alias in node.names:
                target = known.get(f"{base}.{alias.name}") or known.get(base)
                if target is not None and target != name:
                    out.add(target)
    return out


def _graph() -> nx.DiGraph:
    modules = _modules()
    g = nx.DiGraph()
    g.add_nodes_from(modules)
    for name, path in modules.items():
        g.add_edges_from((name, t) for t in _imports(name, path, modules))
    return g


def _node(module: str) -> str:
    """A module's folder (its first directory under megatrain/), or the top-level module itself."""
    first = module.split(".")[0]
    return first if (PACKAGE / first).is_dir() and module != "megatrain" else module


def test_no_python_file_is_over_500_lines():
    long = [f"{p.relative_to(REPO)}: {n} lines" for p in _python_files("megatrain", "tests", "benchmarks", "examples")
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, "split these by concern:\n" + "\n".join(long)


def test_every_folder_has_a_layer():
    nodes = {_node(m) for m in _modules()}
    layered = {n for layer in LAYERS for n in layer}
    assert nodes == layered, f"not in LAYERS: {sorted(nodes - layered)}; gone: {sorted(layered - nodes)}"


def test_no_import_cycle_between_folders():
    g = _graph()
    folders = nx.DiGraph()
    folders.add_edges_from((_node(a), _node(b)) for a, b in g.edges if _node(a) != _node(b))
    cycles = [c for c in nx.strongly_connected_components(folders) if len(c) > 1]
    assert not cycles, [sorted(c) for c in cycles]


def test_imports_only_go_down_the_layers():
    rank = {n: i for i, layer in enumerate(LAYERS) for n in layer}
    g = _graph()
    up = [f"{a} -> {b}" for a, b in g.edges
          if _node(a) != _node(b) and rank.get(_node(b), -1) >= rank.get(_node(a), len(LAYERS))]
    assert not up, "imports up (or across) the layers; move the code to the layer it belongs to:\n" + "\n".join(
        sorted(up))


def test_no_import_cycle_inside_a_folder():
    g = _graph()
    cycles = []
    for folder in {_node(m) for m in g} - {"megatrain"}:
        inside = g.subgraph(m for m in g if _node(m) == folder)
        cycles += [sorted(c) for c in nx.strongly_connected_components(inside) if len(c) > 1]
    assert not cycles, cycles


def test_the_graph_sees_lazy_and_relative_imports(tmp_path):
    """The check would pass vacuously if it missed the imports it exists for."""
    g = _graph()
    assert ("cli", "megatrain") in g.edges  # `from megatrain import __version__`
    assert any(a.startswith("ir.") and b.startswith("models") for a, b in g.edges)  # the tracer runs templates
    path = tmp_path / "mod.py"
    path.write_text("def f():\n    from ..planner import plan\n    from . import engine\n")
    modules = {"runtime": PACKAGE / "runtime" / "__init__.py", "runtime.engine": path,
               "runtime.lazy": path, "planner": PACKAGE / "planner" / "__init__.py", "planner.plan": path}
    assert _imports("runtime.lazy", path, modules) == {"planner.plan", "runtime.engine"}
