"""Moved: the speculative engine now lives in `jaxspec.engine` (core.py, accept.py, tree.py, telemetry.py,
generator.py; proposers/: base.py, eagle3.py, ngram.py; auto/: config.py, generator.py, step_costs.py,
step_cost_store.py). This package only keeps the old import paths working: each old module name is registered as
an alias of its new module, so `from jaxspec.spec.engine import spec_step` still imports
`jaxspec.engine.core.spec_step` (the same module object: monkeypatching either name patches both)."""

import importlib
import sys

MOVED = {
    "engine": "jaxspec.engine.core",
    "accept": "jaxspec.engine.accept",
    "tree": "jaxspec.engine.tree",
    "telemetry": "jaxspec.engine.telemetry",
    "generator": "jaxspec.engine.generator",
    "proposer": "jaxspec.engine.proposers.base",
    "eagle3_proposer": "jaxspec.engine.proposers.eagle3",
    "ngram": "jaxspec.engine.proposers.ngram",
    "auto_config": "jaxspec.engine.auto.config",
    "auto_generator": "jaxspec.engine.auto.generator",
    "step_costs": "jaxspec.engine.auto.step_costs",
    "step_cost_store": "jaxspec.engine.auto.step_cost_store",
}

for _old, _new in MOVED.items():
    globals()[_old] = sys.modules[f"{__name__}.{_old}"] = importlib.import_module(_new)
