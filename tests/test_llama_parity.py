"""Logit and aux-feature parity of the NNX target against transformers (PyTorch, float32)."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_tiny import FAMILIES, make_tiny

from jaxspec.checkpoints.hf import load_target
from jaxspec.models.numerics import held_dtype


@pytest.mark.parametrize("family", [  # CI: one mixture of experts (qwen3_moe); the other two under -m slow
    pytest.param(f, marks=pytest.mark.slow) if f in ("mixtral", "qwen2_moe_shared") else f for f in FAMILIES])
def test_logits_and_aux_match_transformers(family, tmp_path):
    hf = make_tiny(family, tmp_path)
    model = load_target(tmp_path, aux_layer_ids=(0, 2, 3))
    tokens = np.random.default_rng(1).integers(0, 97, (2, 40))
    positions = np.broadcast_to(np.arange(40), (2, 40))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens), output_hidden_states=True)
    out = model(jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32), model.init_cache(2, 64), return_aux=True)
    assert np.abs(np.asarray(out.logits) - ref.logits.numpy()).max() <= 1e-4
    want_aux = np.concatenate([ref.hidden_states[i].numpy() for i in (0, 2, 3)], axis=-1)
    assert out.aux.shape == (2, 40, 3 * 64)
    np.testing.assert_allclose(np.asarray(out.aux), want_aux, atol=1e-5, rtol=1e-5)


def test_default_aux_layers_are_eagle3s(tmp_path):
    make_tiny("smollm2_tied", tmp_path)
    assert load_target(tmp_path).config.aux_layer_ids == (2, 2, 1)  # (2, L//2, L-3) with L = 4


@pytest.mark.slow  # a sanity bound, not a promise: bfloat16's exactness is test_invariance's and test_smollm2's
def test_bfloat16_stays_close_to_float32(tmp_path):
    make_tiny("llama3_scaled", tmp_path)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 97, (1, 24)), jnp.int32)
    positions = jnp.arange(24, dtype=jnp.int32)[None]
    logits = []
    for dtype in (jnp.float32, jnp.bfloat16):
        model = load_target(tmp_path, dtype=dtype)
        assert model.dtype == dtype and model.layers[0].self_attn.q_proj.kernel[...].dtype == held_dtype(dtype)
        logits.append(np.asarray(model(tokens, positions, model.init_cache(1, 32)).logits))
    assert logits[1].dtype == np.float32
    # bfloat16 keeps ~3 significant digits; logits of this tiny model are O(0.1-1).
    assert np.abs(logits[0] - logits[1]).max() < 5e-2


def test_sharded_checkpoint_loads_the_same(tmp_path):
    hf = make_tiny("qwen2_bias", tmp_path / "single")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 97, (1, 12)), jnp.int32)
    positions = jnp.arange(12, dtype=jnp.int32)[None]
    a, b = (load_target(tmp_path / name) for name in ("single", "sharded"))
    np.testing.assert_array_equal(
        np.asarray(a(tokens, positions, a.init_cache(1, 16)).logits),
        np.asarray(b(tokens, positions, b.init_cache(1, 16)).logits),
    )


@pytest.mark.slow  # orbax loading stays in CI: test_mesh's restore straight into the mesh shardings
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_orbax_round_trip_gives_identical_logits(dtype, tmp_path):
    from jaxspec.checkpoints.orbax_target import is_orbax_target, save_target_orbax

    make_tiny("qwen3_qknorm", tmp_path / "hf")
    model = load_target(tmp_path / "hf", dtype=dtype)
    model.hold_step_weights()  # as a Generator leaves it (CPU): only the weights are saved, not what is derived
    out = save_target_orbax(model, tmp_path / "hf", tmp_path / "orbax")
    assert is_orbax_target(out) and (out / "config.json").is_file()
    again = load_target(out, dtype=dtype)  # load_target recognizes the converted directory
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 97, (2, 10)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(10, dtype=jnp.int32), (2, 10))
    np.testing.assert_array_equal(
        np.asarray(model(tokens, positions, model.init_cache(2, 16)).logits),
        np.asarray(again(tokens, positions, again.init_cache(2, 16)).logits),
    )
    if jnp.dtype(dtype) == jnp.bfloat16:  # stored in the model dtype, however this backend holds the weights
        wide = save_target_orbax(load_target(tmp_path / "hf"), tmp_path / "hf", tmp_path / "orbax32")
        size = {d: sum(p.stat().st_size for p in (d / "params").rglob("*") if p.is_file()) for d in (out, wide)}
        assert size[out] < 0.6 * size[wide]


def _shapes(module) -> dict:
    from flax import nnx

    return {path: (tuple(x.shape), x.dtype) for path, x in nnx.to_flat_state(nnx.state(module))}


@pytest.mark.parametrize("family", ["qwen2_bias", "smollm2_tied", "llama3_scaled"])
def test_loaders_shape_only_build_matches_eval_shape(family, tmp_path):
    """Loaders build modules with rngs=None (no tracing); they must have exactly nnx.eval_shape's tree."""
    from fit_head import head_config_for
    from flax import nnx

    from jaxspec.config import load_target_config
    from jaxspec.models.eagle3 import Eagle3Head
    from jaxspec.models.llama import LlamaModel

    make_tiny(family, tmp_path)
    cfg = load_target_config(tmp_path)
    for dtype in (jnp.float32, jnp.bfloat16):
        traced = nnx.eval_shape(lambda: LlamaModel(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
        assert _shapes(LlamaModel(cfg, dtype=dtype, rngs=None)) == _shapes(traced)
        target = load_target(tmp_path)
        for variant in ({}, {"draft_vocab_size": 32, "fc_norm": True, "has_embed_tokens": True, "num_layers": 2}):
            hcfg = head_config_for(target, **variant)
            traced = nnx.eval_shape(lambda: Eagle3Head(hcfg, dtype=dtype, rngs=nnx.Rngs(0)))
            assert _shapes(Eagle3Head(hcfg, dtype=dtype, rngs=None)) == _shapes(traced)


def test_orbax_target_that_does_not_match_gets_a_clear_error(tmp_path):
    import json

    from jaxspec.checkpoints.orbax_target import save_target_orbax
    from jaxspec.errors import JaxspecError

    make_tiny("qwen2_bias", tmp_path / "hf")
    out = save_target_orbax(load_target(tmp_path / "hf"), tmp_path / "hf", tmp_path / "orbax")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] + 8}))
    with pytest.raises(JaxspecError, match=r"does not match its config.json: layers\.0\.mlp\.down_proj\.kernel has shape"):
        load_target(out)
    (out / "config.json").write_text(json.dumps(config))
    data = max((p for p in (out / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with open(data, "r+b") as f:
        f.truncate(100)
    with pytest.raises(JaxspecError, match="cannot restore the orbax target .*convert the target again"):
        load_target(out)
