"""The speculative engine: draft with a proposer, verify with the target, accept, commit — one jitted step.

    core.py        the on-device state, prefill and step (target-only decode, or propose → verify → accept → commit)
    accept.py      forced acceptance for benchmarks, and chain wrappers over `pallas_kernels.rejection`
    tree.py        EAGLE-2 dynamic draft trees
    telemetry.py   why drafts are rejected, counted on device
    generation.py  Generator, the host side: batches, shape buckets, compiles, streams and times generation,
                   target-only or with a proposer (`jaxspec.generation`, its old name, still imports it)
    generator.py   SpeculativeGenerator: a `Generator` drafting with an EAGLE-3 head
    proposers/     the Proposer contract (base.py) and its implementations (eagle3.py, ngram.py)
    auto/          automatic speculation: the arithmetic (config.py), the timed step costs (step_costs.py) and their
                   store on disk (step_cost_store.py), and the generator that chooses per batch (generator.py)
"""
