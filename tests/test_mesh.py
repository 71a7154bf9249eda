"""Sharded inference on 8 simulated CPU devices: a data=2 × model=4 mesh gives the single-device output token for
token, with parameters and KV caches really split; the kernels run per shard; bad meshes get clear errors. A model
axis wider than the KV heads repeats each KV head in the cache and gives the same output too: here on 8 devices,
on 9 in a process of its own (tests/wide_mesh_worker.py), and with the built-in SmolLM2 through the CLI."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

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
from jaxspec.engine.generation import Generator
from jaxspec.models import kv_cache as kvc
from jaxspec.models.llama import LlamaModel
from jaxspec.engine.generator import SpeculativeGenerator
from jaxspec.engine.tree import TreeConfig
from pallas_kernels import invariant_attention, rejection

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS host device count)")


def _tiny_target(num_layers: int, num_kv_heads: int, seed: int) -> LlamaModel:
    """Like the engine tests' tiny target (8 query heads, embeddings dominating the residual stream)."""
    cfg = TargetConfig(
        vocab_size=104, hidden_size=64, intermediate_size=128, num_layers=num_layers, num_heads=8,
        num_kv_heads=num_kv_heads, head_dim=16,
    )
    model = LlamaModel(cfg, rngs=nnx.Rngs(seed))
    model.embed_tokens.set_value(model.embed_tokens[...] * 20.0)
    return model


@functools.cache
def target() -> LlamaModel:
    """Head counts and a vocabulary the model axis (4) divides."""
    return _tiny_target(num_layers=4, num_kv_heads=4, seed=0)


@functools.cache
def head():
    return fit_head(target(), steps=300)


@functools.cache
def mesh():
    return sharding.make_mesh(sharding.MeshConfig(data=2, model=4))


def _ids(completions):
    return [c.token_ids for c in completions]


@pytest.mark.slow  # CI: the repeated-KV tree below (its reference is one device's), test_cli's data mesh, multi-host
def test_target_only_on_the_mesh_equals_one_device():
    single = Generator(target(), batch_size=4).generate(PROMPTS, max_new_tokens=24)
    sharded = Generator(target(), batch_size=4, mesh=mesh()).generate(PROMPTS, max_new_tokens=24)
    assert _ids(sharded) == _ids(single)


@pytest.mark.slow  # CI: the tree on a mesh whose model axis repeats the KV heads (below)
@pytest.mark.parametrize("tree", [None, TreeConfig(total_tokens=10, depth=4, top_k=3)], ids=["chain", "tree"])
def test_speculative_on_the_mesh_equals_one_device(tree):
    reference = Generator(target(), batch_size=4).generate(PROMPTS, max_new_tokens=24)
    gen = SpeculativeGenerator(target(), head(), num_draft=4, tree=tree, batch_size=4, mesh=mesh())
    out = gen.generate(PROMPTS, max_new_tokens=24)
    assert _ids(out) == _ids(reference)
    assert np.mean([c.stats["mean_accepted_length"] for c in out]) > 1.5  # drafts were really accepted


@pytest.mark.slow  # 41 s; the n-gram proposer's exactness stays in CI on one device (test_ngram_proposer)
@pytest.mark.parametrize("batch", [2, 4])
def test_ngram_on_the_mesh_equals_one_device(batch):
    """Prompt lookup's on-device history and its root-only steps (`lax.cond` when no row matched) under the mesh."""
    from jaxspec.engine.proposers.ngram import NgramProposer

    prompts = PROMPTS + [PROMPTS[1] * 3]
    reference = Generator(target(), batch_size=1).generate(prompts, max_new_tokens=24)
    out = Generator(target(), proposer=NgramProposer(4, 2, 3), batch_size=batch, mesh=mesh()).generate(
        prompts, max_new_tokens=24
    )
    assert _ids(out) == _ids(reference)
    outcomes = {k: sum(c.stats["rejections"][k] for c in out) for k in ("no_draft", "miss", "all_accepted")}
    assert outcomes["no_draft"] > 0 and outcomes["miss"] + outcomes["all_accepted"] > 0


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
    (prefill,) = gen.compiled_programs("prefill")
    prompt = jnp.zeros((4, 16), jnp.int32)
    st = prefill(gen.params, gen.head_params, prompt, jnp.full((4,), 5), jnp.full((4,), 8), jnp.zeros((1,), jnp.int32),
                 jax.random.split(jax.random.key(0), 4), None, None)  # no logit processors, greedy
    capacity = st.cache.capacity
    for cache, kv_heads in ((st.cache, 4), (st.proposer.head_cache, 4)):
        k = cache.k[0]
        assert k.shape == (4, kv_heads, capacity, 16)
        assert _shard_shapes(k) == {(2, kv_heads // 4, capacity, 16)}  # rows over data, KV heads over model
        assert k.sharding.spec[:2] == ("data", "model")
    (step,) = gen.compiled_programs("step")
    st = step(gen.params, gen.head_params, st, jnp.zeros((1,), jnp.int32))
    assert _shard_shapes(st.cache.v[-1]) == {(2, 1, capacity, 16)}  # the step keeps the cache split


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
        Generator(target(), batch_size=3, mesh=mesh())
    three = sharding.make_mesh(sharding.MeshConfig(data=1, model=3))
    with pytest.raises(JaxspecError, match=r"8 query and 4 KV heads.*model axis \(3\).*model in \[1, 2, 4, 8\]"):
        Generator(target(), batch_size=2, mesh=three)


def test_dimensions_the_model_axis_does_not_divide_stay_replicated():
    assert sharding.param_spec(["lm_head", "kernel"], (64, 101), 4) == P()
    assert sharding.param_spec(["lm_head", "kernel"], (64, 104), 4) == P(None, "model")
    assert sharding.param_spec(["layers", "0", "mlp", "down_proj", "bias"], (64,), 4) == P()


@pytest.mark.slow  # ~20 s; CI: bench --load-time restores an orbax target onto a data=2 mesh (test_cli)
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
    reference = Generator(load_target(tmp_path / "hf"), batch_size=4).generate(PROMPTS, max_new_tokens=12)
    sharded = Generator(model, batch_size=4, mesh=mesh_4x2).generate(PROMPTS, max_new_tokens=12)
    assert _ids(sharded) == _ids(reference)


# --- A model axis wider than the KV heads: each KV head repeated in the cache (sharding.kv_head_replication) ---


def test_kv_heads_repeat_when_the_model_axis_is_wider():
    assert [sharding.kv_head_replication(9, 3, m) for m in (1, 3, 9)] == [1, 1, 3]  # SmolLM2-135M
    assert [sharding.kv_head_replication(64, 8, m) for m in (8, 16, 32, 64)] == [1, 2, 4, 8]  # Llama-3-70B
    assert sharding.kv_head_replication(8, 4, 2) == 1  # KV heads split over the axis
    fits = [m for m in range(1, 17) if sharding.model_axis_fits(12, 4, m)]
    assert fits == [1, 2, 4, 12]  # 3 and 6 split neither the 4 KV heads nor a whole number of them
    new = jnp.arange(2 * 3 * 2 * 1, dtype=jnp.float32).reshape(2, 3, 2, 1)  # [B, T, Hkv, D]
    repeated = kvc.repeat_heads(new, 6)  # [B, T, 6, D]: head j is KV head j // 3
    np.testing.assert_array_equal(repeated[:, :, [0, 1, 2, 3, 4, 5]], new[:, :, [0, 0, 0, 1, 1, 1]])
    assert kvc.repeat_heads(new, 2) is new


IN_CI = {("chain", "bfloat16", 9), ("tree", "float32", 8), ("tree", "bfloat16", 9)}


@pytest.mark.parametrize("kind, dtype, t, impl, hq, hkv", [  # CI: each kind once, the group sizes alternating
    pytest.param(*case, hq, hkv, marks=() if (case[0], case[1], hq) in IN_CI else pytest.mark.slow)
    for case in (("chain", "bfloat16", 1, "reference"), ("tree", "float32", 6, "reference"),
                 ("tree", "bfloat16", 5, "interpret"))
    for hq, hkv in ((9, 3), (8, 2))
])
def test_invariant_attention_rows_do_not_depend_on_the_group_size(kind, dtype, t, impl, hq, hkv):
    """What makes a wide model axis give one device's bits: the target's attention over the cache with each KV head
    repeated r times (G / r query heads per KV head, down to one row, which is padded to two) gives every query row
    the same bits as over the unrepeated cache (G query heads per KV head)."""
    from test_invariant_attention import KEY_BLOCK, bits, make_inputs

    args, num_blocks = make_inputs(f"group {kind} {hq}", kind, dtype, 2, t, hq, hkv, 16, 160, (7, 100), 3)
    q, k_cache, v_cache, *rest = args
    attend = jax.jit(functools.partial(
        invariant_attention.invariant_attend, key_block=KEY_BLOCK, num_blocks=num_blocks, impl=impl
    ))
    want = bits(attend(*args))
    for r in [r for r in range(2, hq // hkv + 1) if hq % (hkv * r) == 0]:
        got = attend(q, jnp.repeat(k_cache, r, axis=1), jnp.repeat(v_cache, r, axis=1), *rest)
        np.testing.assert_array_equal(bits(got), want, err_msg=f"KV heads repeated {r} times")


@functools.cache
def narrow_kv_target() -> LlamaModel:
    """8 query heads on 2 KV heads: model=4 and model=8 are wider than the KV heads (each repeated 2 or 4 times)."""
    return _tiny_target(num_layers=3, num_kv_heads=2, seed=1)


@functools.cache
def narrow_kv_head():
    return fit_head(narrow_kv_target(), steps=100, n_seqs=32, seq_len=32)


@functools.cache
def narrow_kv_reference() -> list[list[int]]:
    return _ids(Generator(narrow_kv_target(), batch_size=4).generate(PROMPTS, max_new_tokens=24))


# both slow: CI repeats KV heads on a mesh in the speculative tree test below (data=2, model=4, 2 KV heads)
@pytest.mark.parametrize("data, model", [pytest.param(2, 4, marks=pytest.mark.slow),
                                         pytest.param(1, 8, marks=pytest.mark.slow)])
def test_a_model_axis_wider_than_the_kv_heads_equals_one_device(data, model):
    wide = sharding.make_mesh(sharding.MeshConfig(data=data, model=model))
    gen = Generator(narrow_kv_target(), batch_size=4, mesh=wide)
    assert _ids(gen.generate(PROMPTS, max_new_tokens=24)) == narrow_kv_reference()
    # the cache holds `model` KV heads (2 repeated model / 2 times), one per device; 3 layers' K and V, float32
    capacity = gen.memory.cache_capacity
    assert gen.memory.target_kv_cache == 2 * 3 * (4 // data) * 1 * capacity * 16 * 4 + (4 // data) * 4
    with sharding.mesh_context(wide):
        cache = jax.jit(lambda: kvc.constrain(narrow_kv_target().init_cache(4, 32)))()
    assert cache.k[0].shape == (4, model, 32, 16) and _shard_shapes(cache.k[0]) == {(4 // data, 1, 32, 16)}
    attn = gen.params["layers"][0]["self_attn"]
    assert _shard_shapes(attn["q_proj"]["kernel"][...]) == {(64, 128 // model)}  # whole query heads per device
    # k/v projections (2 heads of 16 = 32 outputs) divide the axis, so they are split by output features like any
    # other, cutting a head (XLA gathers K and V before the repeat); a width that does not divide stays replicated
    assert _shard_shapes(attn["k_proj"]["kernel"][...]) == {(64, 32 // model)}


# both slow: in CI, speculation on a mesh whose model axis (4) repeats 2 KV heads is test_moe's experts-on-the-mesh
# test, and trees' attention per shard is test_invariant_attention_rows_do_not_depend_on_the_group_size below
@pytest.mark.parametrize("tree", [pytest.param(None, marks=pytest.mark.slow),
                                  pytest.param(TreeConfig(total_tokens=10, depth=4, top_k=3), marks=pytest.mark.slow)],
                         ids=["chain", "tree"])
def test_speculative_with_repeated_kv_heads_equals_one_device(tree):
    wide = sharding.make_mesh(sharding.MeshConfig(data=2, model=4))
    gen = SpeculativeGenerator(narrow_kv_target(), narrow_kv_head(), num_draft=4, tree=tree, batch_size=4, mesh=wide)
    out = gen.generate(PROMPTS, max_new_tokens=24)
    assert _ids(out) == narrow_kv_reference()
    assert np.mean([c.stats["mean_accepted_length"] for c in out]) > 1.5  # drafts were really accepted
    assert gen.memory.head_kv_cache % (2 * 2 * 1 * 16 * 4) == 2 * 4  # the head's cache: one KV head per device too


def _run_on_nine_devices(argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=9", "JAXSPEC_COMPILE_CACHE": "off",
           "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=900)


@pytest.mark.slow  # a 9-device subprocess (~2.5 minutes); CI keeps the 8-device repeated-KV-head cases above
def test_nine_devices_for_nine_query_and_three_kv_heads_equal_one_device():
    """Issue #17: `--mesh data=1,model=9` on SmolLM2's head counts (9 query, 3 KV) equals one device, target-only,
    chain and tree, with each KV head repeated on 3 devices: caches [B, 9, S, D] split to one head per device,
    q/o projections split by head, the k/v projections (3 · 16 outputs: not a multiple of 9) replicated."""
    start = time.perf_counter()
    done = _run_on_nine_devices([str(Path(__file__).parent / "wide_mesh_worker.py")])
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("target_only", "chain", "tree"):
        assert out[name] == out["one_device"], name
    assert out["chain_accepted"] > 1.5 and out["tree_accepted"] > 1.5  # drafts were really accepted
    assert out["weights"] == {"q_proj": [[64, 16]], "o_proj": [[16, 64]], "k_proj": [[64, 48]], "v_proj": [[64, 48]]}
    assert out["head_weights"] == {"q_proj": [[128, 16]], "o_proj": [[16, 64]], "k_proj": [[128, 48]]}
    assert out["cache"] == {"shape": [2, 9, 32, 16], "shards": [[2, 1, 32, 16]], "head_shape": [2, 9, 32, 16],
                            "head_shards": [[2, 1, 32, 16]]}
    for name, kv_heads in (("one_device", 3), ("target_only", 1), ("chain", 1), ("tree", 1)):
        report = out["memory"][name]  # 3 layers' K and V [2, heads, capacity, 16] float32, and the lengths
        assert report["target_kv_cache"] == 2 * 3 * 2 * kv_heads * report["cache_capacity"] * 16 * 4 + 2 * 4, name
    for name in ("chain", "tree"):
        assert out["memory"][name]["head_kv_cache"] % (2 * 2 * 1 * 16 * 4) == 2 * 4, name
    print(f"nine devices: {time.perf_counter() - start:.0f} s")


@pytest.mark.slow
@pytest.mark.smollm2
def test_the_cli_on_nine_devices_equals_one_device_with_smollm2():
    """The issue's command: the built-in SmolLM2-135M (9 query / 3 KV heads) and its shipped head (the default
    draft, 9 / 3 heads too) on `--mesh data=1,model=9` print the single-device tokens; each device holds one
    KV head per layer."""
    from jaxspec.checkpoints import builtin

    builtin.ensure_default_target()
    argv = ["-m", "jaxspec.generate", "--max-new-tokens", "16", "--json", "--memory-report",
            "--prompt", "Explain speculative decoding in one sentence."]
    outputs = []
    for mesh in ([], ["--mesh", "data=1,model=9"]):
        done = _run_on_nine_devices(argv + mesh)
        assert done.returncode == 0, done.stderr[-3000:]
        outputs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    one, nine = outputs
    assert nine["token_ids"] == one["token_ids"] and len(one["token_ids"]) == 16
    mem = nine["memory"]
    assert mem["devices"] == 9
    assert mem["target_kv_cache"] == 2 * 30 * 1 * 1 * mem["cache_capacity"] * 64 * 4 + 4  # K, V: one head per device


@pytest.mark.slow  # int8's CI case runs on one device (test_quantize); here its scales shard with their columns
def test_an_int8_target_on_the_mesh_equals_one_device():
    from jaxspec.models.quantize import quantize_target

    quantized = quantize_target(nnx.merge(*nnx.split(target())), "int8")
    reference = Generator(quantized, batch_size=4).generate(PROMPTS, max_new_tokens=24)
    gen = SpeculativeGenerator(quantized, head(), num_draft=4, batch_size=4, mesh=mesh())
    out = gen.generate(PROMPTS, max_new_tokens=24)
    assert _ids(out) == _ids(reference)
    assert np.mean([c.stats["mean_accepted_length"] for c in out]) > 1.5
    q_proj = gen.params["layers"][0]["self_attn"]["q_proj"]
    assert _shard_shapes(q_proj["scale"][...]) == {(128 // 4,)}  # with its kernel's output columns
    assert _shard_shapes(q_proj["kernel"][...]) == {(64, 128 // 4)}
