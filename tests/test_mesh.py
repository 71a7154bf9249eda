"""Sharded inference on 8 simulated CPU devices: a data=2 × model=4 mesh gives the single-device output token for
token, with parameters and KV caches really split; the kernels run per shard; bad meshes get clear errors."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fit_head import fit_head
from flax import nnx
from jax.sharding import PartitionSpec as P
from spec_fixtures import PROMPTS

from jaxspec import sharding
from jaxspec.config import TargetConfig
from jaxspec.errors import JaxspecError
from jaxspec.generation import TargetGenerator
from jaxspec.models.llama import LlamaModel
from jaxspec.spec.generator import SpeculativeGenerator
from jaxspec.spec.tree import TreeConfig
from pallas_kernels import invariant_attention, rejection

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS host device count)")


@functools.cache
def target() -> LlamaModel:
    """Like the engine tests' tiny target, with head counts and a vocabulary the model axis (4) divides."""
    cfg = TargetConfig(
        vocab_size=104, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=16
    )
    model = LlamaModel(cfg, rngs=nnx.Rngs(0))
    model.embed_tokens.set_value(model.embed_tokens[...] * 20.0)
    return model


@functools.cache
def head():
    return fit_head(target(), steps=300)


@functools.cache
def mesh():
    return sharding.make_mesh(sharding.MeshConfig(data=2, model=4))


def _ids(completions):
    return [c.token_ids for c in completions]


def test_target_only_on_the_mesh_equals_one_device():
    single = TargetGenerator(target(), batch_size=4).generate(PROMPTS, max_new_tokens=24)
    sharded = TargetGenerator(target(), batch_size=4, mesh=mesh()).generate(PROMPTS, max_new_tokens=24)
    assert _ids(sharded) == _ids(single)


@pytest.mark.parametrize("tree", [None, TreeConfig(total_tokens=10, depth=4, top_k=3)], ids=["chain", "tree"])
def test_speculative_on_the_mesh_equals_one_device(tree):
    reference = TargetGenerator(target(), batch_size=4).generate(PROMPTS, max_new_tokens=24)
    gen = SpeculativeGenerator(target(), head(), num_draft=4, tree=tree, batch_size=4, mesh=mesh())
    out = gen.generate(PROMPTS, max_new_tokens=24)
    assert _ids(out) == _ids(reference)
    assert np.mean([c.stats["mean_accepted_length"] for c in out]) > 1.5  # drafts were really accepted


def _shard_shapes(x) -> set[tuple[int, ...]]:
    return {s.data.shape for s in x.addressable_shards}


def test_parameters_and_caches_are_split_not_replicated():
    gen = SpeculativeGenerator(target(), head(), num_draft=4, batch_size=4, mesh=mesh())
    layer = gen.params["layers"][0]
    assert _shard_shapes(layer["self_attn"]["q_proj"]["kernel"][...]) == {(64, 128 // 4)}  # heads split over model
    assert _shard_shapes(layer["self_attn"]["o_proj"]["kernel"][...]) == {(128 // 4, 64)}
    assert _shard_shapes(layer["mlp"]["down_proj"]["kernel"][...]) == {(128 // 4, 64)}
    assert _shard_shapes(gen.params["embed_tokens"][...]) == {(104 // 4, 64)}  # vocabulary split
    assert _shard_shapes(gen.params["lm_head"]["kernel"][...]) == {(64, 104 // 4)}
    assert _shard_shapes(layer["input_layernorm"]["weight"][...]) == {(64,)}  # norms replicated
    assert _shard_shapes(gen.head_params["midlayer"]["self_attn"]["k_proj"]["kernel"][...]) == {(128, 64 // 4)}

    gen.generate(PROMPTS, max_new_tokens=8)  # compiles prefill and step for this shape
    (prefill,) = [f for key, f in gen._compiled.items() if key[0] == "prefill"]
    prompt = jnp.zeros((4, 16), jnp.int32)
    st = prefill(gen.params, gen.head_params, prompt, jnp.full((4,), 5), jnp.full((4,), 8), jnp.zeros((1,), jnp.int32),
                 jax.random.key(0))
    capacity = st.target_cache.capacity
    for cache, kv_heads in ((st.target_cache, 4), (st.head_cache, 4)):
        k = cache.k[0]
        assert k.shape == (4, kv_heads, capacity, 16)
        assert _shard_shapes(k) == {(2, kv_heads // 4, capacity, 16)}  # rows over data, KV heads over model
        assert k.sharding.spec[:2] == ("data", "model")
    (step,) = [f for key, f in gen._compiled.items() if key[0] == "step"]
    st = step(gen.params, gen.head_params, st, jnp.zeros((1,), jnp.int32))
    assert _shard_shapes(st.target_cache.v[-1]) == {(2, 1, capacity, 16)}  # the step keeps the cache split


@pytest.mark.parametrize("t", [1, 6])
def test_attention_kernel_per_shard_equals_reference(t):
    """The target's attention kernel (interpret mode) run per shard of the mesh gives the reference's bits."""
    rng = np.random.default_rng(t)
    b, hkv, g, d, s = 4, 4, 2, 16, 160
    q = jnp.asarray(rng.normal(size=(b, t, hkv * g, d)), jnp.float32)
    k_cache, v_cache = (jnp.asarray(rng.normal(size=(b, hkv, s, d)), jnp.float32) for _ in range(2))
    lengths = jnp.asarray([0, 7, 70, s - t], jnp.int32)  # the new tokens' K/V sit at slots lengths + i
    positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)
    args = (q, k_cache, v_cache, lengths, positions, None)
    want = invariant_attention.invariant_attend(*args, key_block=64, num_blocks=None, impl="reference")
    with jax.set_mesh(mesh()):
        got = jax.jit(functools.partial(
            invariant_attention.invariant_attend, key_block=64, num_blocks=None, impl="interpret"
        ))(*args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_verification_kernel_per_shard_equals_reference():
    rng = np.random.default_rng(0)
    b, n, v = 4, 6, 16
    tokens = jnp.asarray(rng.integers(0, v, (b, n)), jnp.int32)
    parents = rejection.chain_parents(b, n)
    probs = jax.nn.softmax(jnp.asarray(rng.normal(size=(b, n, v)) * 3, jnp.float32), axis=-1)
    q = jax.nn.softmax(jnp.asarray(rng.normal(size=(b, n, v)), jnp.float32), axis=-1)
    uniforms = jnp.asarray(rng.random((b, n)), jnp.float32)
    noise = jnp.asarray(rng.exponential(size=(b, v)), jnp.float32)
    kernel = functools.partial(rejection.verify, mode="chain", max_depth=n - 1, interpret=True)
    got = rejection.per_shard(kernel, mesh(), with_q=True)(tokens, parents, probs, uniforms, noise, q)
    want = rejection.verify_reference(tokens, parents, probs, uniforms, noise, q, mode="chain", max_depth=n - 1)
    for a, b_ in zip(got, want):
        np.testing.assert_array_equal(a, b_)


def test_bad_meshes_are_clear_errors():
    with pytest.raises(JaxspecError, match="data=D,model=M"):
        sharding.MeshConfig.parse("data=2,tensor=4")
    assert sharding.MeshConfig.parse("model=2") == sharding.MeshConfig(1, 2)
    with pytest.raises(JaxspecError, match="needs 16 devices"):
        sharding.make_mesh(sharding.MeshConfig(data=4, model=4))
    with pytest.raises(JaxspecError, match="not a multiple of the mesh's data axis"):
        TargetGenerator(target(), batch_size=3, mesh=mesh())
    three = sharding.make_mesh(sharding.MeshConfig(data=1, model=8))
    with pytest.raises(JaxspecError, match=r"8 query and 4 KV heads.*model in \[1, 2, 4\]"):
        TargetGenerator(target(), batch_size=2, mesh=three)


def test_dimensions_the_model_axis_does_not_divide_stay_replicated():
    assert sharding.param_spec(["lm_head", "kernel"], (64, 101), 4) == P()
    assert sharding.param_spec(["lm_head", "kernel"], (64, 104), 4) == P(None, "model")
    assert sharding.param_spec(["layers", "0", "mlp", "down_proj", "bias"], (64,), 4) == P()


def test_an_orbax_target_restores_straight_into_the_mesh_shardings(tmp_path):
    from hf_tiny import make_tiny

    from jaxspec.checkpoints.hf import load_target
    from jaxspec.checkpoints.orbax_target import save_target_orbax

    make_tiny("llama3_scaled", tmp_path / "hf", seed=1)  # 4 query / 2 KV heads
    out = save_target_orbax(load_target(tmp_path / "hf"), tmp_path / "hf", tmp_path / "orbax")
    mesh_4x2 = sharding.make_mesh(sharding.MeshConfig(data=4, model=2))
    model = load_target(out, mesh=mesh_4x2)
    q = model.layers[0].self_attn.q_proj.kernel[...]
    assert q.sharding.spec == P(None, "model") and _shard_shapes(q) == {(64, 64 // 2)}
    reference = TargetGenerator(load_target(tmp_path / "hf"), batch_size=4).generate(PROMPTS, max_new_tokens=12)
    sharded = TargetGenerator(model, batch_size=4, mesh=mesh_4x2).generate(PROMPTS, max_new_tokens=12)
    assert _ids(sharded) == _ids(reference)
