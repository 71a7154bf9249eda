"""Run by tests/test_mesh.py in a process of its own, with XLA_FLAGS simulating 9 CPU devices (the test process has
8): a tiny target with 9 query and 3 KV heads, and a head fitted to it, generate on one device and on a
data=1 × model=9 mesh, where each KV head is repeated on 3 devices. Prints one JSON object: the token ids of each
run, the shard shapes of the weights and caches, and the memory reports (progress with timings on stderr)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py sets

from fit_head import fit_head  # noqa: E402
from flax import nnx  # noqa: E402
from spec_fixtures import PROMPTS  # noqa: E402

from jaxspec import sharding  # noqa: E402
from jaxspec.config import TargetConfig  # noqa: E402
from jaxspec.models import kv_cache as kvc  # noqa: E402
from jaxspec.engine.generation import Generator  # noqa: E402
from jaxspec.models.llama import LlamaModel  # noqa: E402
from jaxspec.engine.generator import SpeculativeGenerator  # noqa: E402
from jaxspec.engine.tree import TreeConfig  # noqa: E402

NEW_TOKENS = 20
START = time.perf_counter()


def target() -> LlamaModel:
    """9 query / 3 KV heads as SmolLM2-135M, small otherwise; vocabulary and MLP width split over 9 too."""
    cfg = TargetConfig(
        vocab_size=108, hidden_size=64, intermediate_size=144, num_layers=3, num_heads=9, num_kv_heads=3, head_dim=16
    )
    model = LlamaModel(cfg, rngs=nnx.Rngs(0))
    model.embed_tokens.set_value(model.embed_tokens[...] * 20.0)  # predictable enough for a fitted head
    return model


def log(what: str) -> None:
    print(f"{time.perf_counter() - START:.1f} s: {what}", file=sys.stderr, flush=True)


def shapes(x: jax.Array) -> list[list[int]]:
    return sorted({tuple(s.data.shape) for s in x.addressable_shards})


def main() -> None:
    assert jax.device_count() == 9, jax.device_count()
    model = target()
    head = fit_head(model, steps=100, n_seqs=32, seq_len=32)
    log("head fitted")
    mesh = sharding.make_mesh(sharding.MeshConfig(data=1, model=9))
    one = Generator(model, batch_size=2)
    out: dict = {"one_device": [c.token_ids for c in one.generate(PROMPTS, max_new_tokens=NEW_TOKENS)]}
    log("one device")
    gen = Generator(model, batch_size=2, mesh=mesh)
    out["target_only"] = [c.token_ids for c in gen.generate(PROMPTS, max_new_tokens=NEW_TOKENS)]
    log("target-only on the mesh")
    out["memory"] = {"one_device": one.memory.as_dict(), "target_only": gen.memory.as_dict()}
    for name, tree in (("chain", None), ("tree", TreeConfig(total_tokens=8, depth=3, top_k=3))):
        spec = SpeculativeGenerator(model, head, num_draft=3, tree=tree, batch_size=2, mesh=mesh)
        completions = spec.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
        out[name] = [c.token_ids for c in completions]
        out[f"{name}_accepted"] = sum(c.stats["mean_accepted_length"] for c in completions) / len(completions)
        out["memory"][name] = spec.memory.as_dict()
        log(name)
    attn = spec.params["layers"][0]["self_attn"]
    head_attn = spec.head_params["midlayer"]["self_attn"]
    out["weights"] = {name: shapes(attn[name]["kernel"][...]) for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    out["head_weights"] = {name: shapes(head_attn[name]["kernel"][...]) for name in ("q_proj", "k_proj", "o_proj")}

    # A cache made inside jit under the mesh, as the generators' prefills make theirs (the memory reports above
    # read the shards of the generators' own caches).
    with sharding.mesh_context(mesh):
        cache = jax.jit(lambda: kvc.constrain(model.init_cache(2, 32)))()
        head_cache = jax.jit(lambda: kvc.constrain(head.init_cache(2, 32)))()
    out["cache"] = {"shape": list(cache.k[0].shape), "shards": shapes(cache.k[0]),
                    "head_shape": list(head_cache.v[0].shape), "head_shards": shapes(head_cache.v[0])}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
