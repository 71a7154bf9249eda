"""Weight-only int8 targets (models/quantize.py): the quantization itself, a quantized target against a float model
holding the dequantized weights, and greedy speculation against quantized target-only generation, bit for bit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from spec_fixtures import PROMPTS, fitted_head, in_dtype, random_head, tiny_target

from jaxspec.engine.generation import Generator
from jaxspec.engine.generator import SpeculativeGenerator
from jaxspec.engine.tree import TreeConfig
from jaxspec.models.quantize import (
    dequantized_kernel, held_int8_dtype, quantize_int8, quantize_target, quantized_linears,
)


def quantized(model):
    """An int8 copy of `model` (its own modules; the float one is left as it is)."""
    return quantize_target(nnx.merge(*nnx.split(model)), "int8")


def test_int8_per_channel_round_trip():
    w = jax.random.normal(jax.random.key(0), (64, 48)) * jnp.linspace(0.01, 3.0, 48)  # columns of other ranges
    w = w.at[:, 5].set(0.0)
    q, scale = quantize_int8(w)
    assert q.dtype == jnp.int8 and scale.shape == (48,) and scale.dtype == jnp.float32
    held, _ = quantize_int8(w, held=jnp.float32)  # as a CPU holds them (held_int8_dtype): the same integers
    assert held.dtype == jnp.float32 and bool(jnp.array_equal(held, q.astype(jnp.float32)))
    assert int(jnp.max(jnp.abs(q.astype(jnp.int32)))) == 127  # each nonzero column uses the whole range
    assert float(scale[5]) == 1.0 and not jnp.any(q[:, 5])  # a zero column stays zero
    err = jnp.abs(q.astype(jnp.float32) * scale - w)
    assert bool(jnp.all(err <= scale / 2 + 1e-6))  # round to nearest: at most half a step per weight


def test_quantized_target_equals_a_float_model_holding_its_dequantized_weights():
    """The int8 target computes (x @ q)·s; a float model holding q·s computes x @ (q·s): the same up to float32
    rounding, while both stay far from the unquantized model. Plain numerics (one dot per matmul: quick to
    compile); the invariant tiles' scale is in the speculation tests below."""
    target = nnx.merge(*nnx.split(tiny_target()))
    target.numerics = None
    q_model = quantized(target)
    float_model = nnx.merge(*nnx.split(target))
    for mine, theirs in zip(quantized_linears(q_model), quantized_linears(float_model)):
        assert mine.kernel[...].dtype == held_int8_dtype()  # float32 on this CPU, int8 on an accelerator
        assert bool(jnp.all(mine.kernel[...] == jnp.round(mine.kernel[...]))) and mine.scale is not None
        theirs.kernel = nnx.Param(dequantized_kernel(mine))
    tokens = jnp.asarray([PROMPTS[1]], jnp.int32)
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]

    def logits(model):
        cache = model.init_cache(1, 64)
        return np.asarray(model(tokens, positions, cache).logits)

    got, dequantized, full = logits(q_model), logits(float_model), logits(target)
    np.testing.assert_allclose(got, dequantized, rtol=1e-4, atol=1e-4)
    assert np.max(np.abs(got - full)) > 100 * np.max(np.abs(got - dequantized))  # the quantization is real
    assert q_model.quantization == "int8" and target.quantization is None and tiny_target().quantization is None


@functools.cache
def reference(dtype) -> list[list[int]]:
    target = quantized(in_dtype(tiny_target(), dtype))
    return [c.token_ids for c in Generator(target, batch_size=1).generate(PROMPTS, max_new_tokens=30)]


# CI: bfloat16 (where rounding differences survive) with a fitted head in a batch of 4; the rest under -m slow.
@pytest.mark.parametrize("how,dtype", [
    pytest.param(how, dtype, id=f"{how}-{jnp.dtype(dtype).name}",
                 marks=() if (how, dtype) == ("chain5-batch4", jnp.bfloat16) else pytest.mark.slow)
    for how in ("chain5-batch4", "chain1-random", "tree") for dtype in (jnp.float32, jnp.bfloat16)
])
def test_greedy_speculation_equals_quantized_target_only(how, dtype):
    target = quantized(in_dtype(tiny_target(), dtype))
    if how == "tree":
        gen = SpeculativeGenerator(target, fitted_head(), tree=TreeConfig(8, 3, 2), batch_size=2)
    elif how == "chain1-random":
        gen = SpeculativeGenerator(target, random_head(), num_draft=1, batch_size=1)
    else:
        gen = SpeculativeGenerator(target, fitted_head(), num_draft=5, batch_size=4)
    got = gen.generate(PROMPTS, max_new_tokens=30)
    assert [c.token_ids for c in got] == reference(dtype)
    if how != "chain1-random":  # the head fitted to the float target still drafts for the int8 one
        assert np.mean([c.stats["mean_accepted_length"] for c in got]) > 1.5


@pytest.mark.slow  # CI's representative: the greedy bfloat16 case above (the flag is three lines of loading)
def test_generate_cli_quantized_speculation_equals_quantized_target_only(tmp_path, capsys, monkeypatch):
    """`jaxspec.generate --quantize int8` on a tiny Hugging Face checkpoint: a chain of 3 with a head gives the
    quantized target's own tokens, and the load note says the weights are int8."""
    import json

    from fit_head import head_config_for
    from hf_tiny import ByteTokenizer, make_tiny

    from jaxspec import generate
    from jaxspec import prompts as prompts_mod
    from jaxspec.checkpoints.heads import export_head
    from jaxspec.checkpoints.hf import load_target
    from jaxspec.models.eagle3 import Eagle3Head

    make_tiny("smollm2_tied", tmp_path / "tiny", seed=5)
    target = load_target(tmp_path / "tiny")
    export_head(Eagle3Head(head_config_for(target), rngs=nnx.Rngs(0)), tmp_path / "head", layout="sglang",
                target=target.config, dtype="float32")
    monkeypatch.setattr(prompts_mod, "load_tokenizer", lambda _: ByteTokenizer())
    base = ["--target", str(tmp_path / "tiny"), "--prompt", "abcab", "--raw", "--json", "--max-new-tokens", "12",
            "--quantize", "int8"]
    runs = {}
    for name, extra in (("target-only", ["--no-draft"]), ("chain", ["--draft", str(tmp_path / "head"),
                                                                       "--num-speculative-tokens", "3"])):
        assert generate.main([*base, *extra]) == 0
        out, err = capsys.readouterr()
        runs[name] = json.loads(out.strip().splitlines()[-1])["token_ids"]
        assert "int8 weights" in err
    assert runs["chain"] == runs["target-only"] and len(runs["chain"]) >= 1
