"""The package layout (docs/ARCHITECTURE.md): imports run one way, ground floor first. pallas_kernels imports nothing
of jaxspec; the project's modules import each other without a cycle; the module names that moved still import (as
the same module objects) or say where they went."""

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("train", "jaxspec", "pallas_kernels")  # top floor first
# compatibility shims: they import the new modules for the old names and nothing in the project imports them
SHIMS = {"jaxspec.spec", "jaxspec._moved"}

MOVED = {
    "jaxspec.spec.engine": "jaxspec.engine.core",
    "jaxspec.spec.accept": "jaxspec.engine.accept",
    "jaxspec.spec.tree": "jaxspec.engine.tree",
    "jaxspec.spec.telemetry": "jaxspec.engine.telemetry",
    "jaxspec.spec.generator": "jaxspec.engine.generator",
    "jaxspec.spec.proposer": "jaxspec.engine.proposers.base",
    "jaxspec.spec.eagle3_proposer": "jaxspec.engine.proposers.eagle3",
    "jaxspec.spec.ngram": "jaxspec.engine.proposers.ngram",
    "jaxspec.spec.auto_config": "jaxspec.engine.auto.config",
    "jaxspec.spec.auto_generator": "jaxspec.engine.auto.generator",
    "jaxspec.spec.step_costs": "jaxspec.engine.auto.step_costs",
    "jaxspec.spec.step_cost_store": "jaxspec.engine.auto.step_cost_store",
    "jaxspec.mesh_axes": "pallas_kernels.mesh_axes",
    "jaxspec.bench_suite": "jaxspec.bench.suite",
    "jaxspec.bench_kernels": "jaxspec.bench.kernels",
    "jaxspec.bench_load": "jaxspec.bench.load",
    "jaxspec.bandwidth": "jaxspec.bench.bandwidth",
    "jaxspec.generation": "jaxspec.engine.generation",
}
SPLIT = {"jaxspec.cli_common": "jaxspec.cli"}


def module_files() -> dict[str, Path]:
    """{dotted module name: source file} of the project's packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imported_modules(path: Path, name: str, modules) -> set[str]:
    """The project modules a file imports anywhere in it (module level and inside functions): `import a.b` → a.b;
    `from a import b` → a.b where that is a module, else a. A package imported only as the parent of a submodule
    does not count (importing a.b runs a/__init__.py, but that is the import system's edge, not the file's)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in out if m.split(".")[0] in PACKAGES}


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported_modules(path, name, modules) for name, path in modules.items()}


def test_imports_run_down_the_floors():
    """pallas_kernels (the ground floor) imports nothing of jaxspec or train, jaxspec nothing of train."""
    floor = {package: i for i, package in enumerate(PACKAGES[::-1])}  # pallas_kernels 0, jaxspec 1, train 2
    upward = {name: sorted(m for m in deps if floor[m.split(".")[0]] > floor[name.split(".")[0]])
              for name, deps in import_graph().items()}
    assert not {name: deps for name, deps in upward.items() if deps}


def test_every_import_names_an_existing_module_and_no_old_path():
    graph = import_graph()
    for name, deps in graph.items():
        for dep in deps:
            assert dep in graph, f"{name} imports {dep}, which is not a module of the project"
            if name not in SHIMS and name != "jaxspec":  # jaxspec/__init__.py installs jaxspec._moved
                assert dep not in SHIMS and dep not in MOVED and dep not in SPLIT, f"{name} imports the old {dep}"


def test_the_import_graph_has_no_cycle():
    graph = {name: deps - SHIMS for name, deps in import_graph().items() if name not in SHIMS}
    state, cycles = {}, []  # state: 1 on the current path, 2 done

    def visit(node, path):
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_a_moved_module_imports_under_its_old_name(old, new):
    assert importlib.import_module(old) is importlib.import_module(new)


def test_old_names_in_from_imports():
    from jaxspec.bench import build_parser, main  # jaxspec.bench was a module: its public names are the package's
    from jaxspec.spec import engine
    from jaxspec.spec.engine import spec_step

    assert engine.spec_step is spec_step and callable(main) and build_parser().prog == "python -m jaxspec.bench"


@pytest.mark.parametrize("old, new", sorted(SPLIT.items()))
def test_a_split_module_says_where_it_went(old, new):
    with pytest.raises(ImportError, match=new):
        importlib.import_module(old)
