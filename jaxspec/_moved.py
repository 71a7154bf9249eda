"""Module names of jaxspec that moved when the packages were laid out by architecture (issue 43), kept importable
where that costs nothing: each name in ALIASES imports its new module (the same module object, so monkeypatching
either name patches both); a name in SPLIT was divided between several modules and raises an ImportError naming
them. `jaxspec.spec.*` has a package of its own (jaxspec/spec/__init__.py). Installed by jaxspec/__init__.py."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

ALIASES = {
    "jaxspec.mesh_axes": "pallas_kernels.mesh_axes",
    "jaxspec.bench_suite": "jaxspec.bench.suite",
    "jaxspec.bench_kernels": "jaxspec.bench.kernels",
    "jaxspec.bench_load": "jaxspec.bench.load",
    "jaxspec.bandwidth": "jaxspec.bench.bandwidth",
    "jaxspec.generation": "jaxspec.engine.generation",
}
SPLIT = {
    "jaxspec.cli_common": "jaxspec.cli_common moved to jaxspec.cli: jaxspec.cli.args (flags and their checks), "
    "jaxspec.cli.loading (target, head and generator loading), jaxspec.cli.program (run_program, main_guard, Ctrl-C, "
    "the compilation cache), jaxspec.cli.mesh (--mesh, --distributed)",
}


class MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old names only; every other import passes by."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in SPLIT:
            raise ImportError(SPLIT[fullname], name=fullname)
        if fullname in ALIASES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        module = importlib.import_module(ALIASES[spec.name])
        spec.loader_state = module.__spec__  # the import system sets module.__spec__ to the alias's; put it back
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state


def install() -> None:
    """First on sys.meta_path: an old name must not be found as a file elsewhere (an older copy of jaxspec, or an
    editable install's finder that maps names to another checkout)."""
    if not any(isinstance(finder, MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())
