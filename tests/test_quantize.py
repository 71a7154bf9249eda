"""Weight-only int8 targets (models/quantize.py): the quantization itself, a quantized target against a float model
holding the dequantized weights, and greedy speculation against quantized target-only generation, bit for bit."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from spec_fixtures import PROMPTS, fitted_head, in_dtype, random_head, tiny_target

from jaxspec.engine.generation import Generator
from jaxspec.engine.generator import SpeculativeGenerator
from jaxspec.engine.tree import TreeConfig
from jaxspec.errors import JaxspecError
from jaxspec.models.quantize import (
    held_dtype_for, quantize_target, quantize_weight, quantized_linears,
)


def dequantized_kernel(linear) -> jax.Array:
    """A quantized Linear's kernel as float32 values q · s (what a float model with the same weights holds)."""
    return linear.kernel[...].astype(jnp.float32) * linear.scale[...]


def quantized(model):
    """An int8 copy of `model` (its own modules; the float one is left as it is)."""
    return quantize_target(nnx.merge(*nnx.split(model)), "int8")


def test_int8_per_channel_round_trip():
    w = jax.random.normal(jax.random.key(0), (64, 48)) * jnp.linspace(0.01, 3.0, 48)  # columns of other ranges
    w = w.at[:, 5].set(0.0)
    q, scale = quantize_weight(w, "int8")
    assert q.dtype == jnp.int8 and scale.shape == (48,) and scale.dtype == jnp.float32
    held, _ = quantize_weight(w, "int8", held=jnp.float32)  # as a CPU holds them (held_dtype_for): the same integers
    assert held.dtype == jnp.float32 and bool(jnp.array_equal(held, q.astype(jnp.float32)))
    assert int(jnp.max(jnp.abs(q.astype(jnp.int32)))) == 127  # each nonzero column uses the whole range
    assert float(scale[5]) == 1.0 and not jnp.any(q[:, 5])  # a zero column stays zero
    err = jnp.abs(q.astype(jnp.float32) * scale - w)
    assert bool(jnp.all(err <= scale / 2 + 1e-6))  # round to nearest: at most half a step per weight


@pytest.mark.slow  # CI: the drift test below runs the same float and int8 forwards (a wrong scale shows there)
def test_quantized_target_equals_a_float_model_holding_its_dequantized_weights():
    """The int8 target computes (x @ q)·s; a float model holding q·s computes x @ (q·s): the same up to float32
    rounding, while both stay far from the unquantized model. Plain numerics (one dot per matmul: quick to
    compile); the invariant tiles' scale is in the speculation tests below."""
    target = nnx.merge(*nnx.split(tiny_target()))
    target.numerics = None
    q_model = quantized(target)
    float_model = nnx.merge(*nnx.split(target))
    for mine, theirs in zip(quantized_linears(q_model), quantized_linears(float_model)):
        assert mine.kernel[...].dtype == held_dtype_for("int8")  # float32 on this CPU, int8 on an accelerator
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


def compressed_tensors_copy(src, dst, strategy: str = "channel", **config_changes):
    """A compressed-tensors FP8 checkpoint of the float checkpoint `src`, written as RedHatAI's FP8-dynamic models
    are (each decoder Linear's `weight` in float8_e4m3fn [out, in] beside `weight_scale` [out, 1], or [1] per
    tensor; `quantization_config` in config.json; the LM head ignored), quantized here with numpy and ml_dtypes,
    independently of models/quantize.py."""
    import json
    import shutil

    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    out = {}
    for key, w in tensors.items():
        if key.endswith(".weight") and any(f".{p}." in key for p in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                       "gate_proj", "up_proj", "down_proj")):
            w = w.astype(np.float32)  # [out, in]
            absmax = np.abs(w).max(axis=1, keepdims=True) if strategy == "channel" else np.abs(w).max(keepdims=True)
            scale = np.where(absmax > 0, absmax / np.float32(448.0), np.float32(1.0)).astype(np.float32)
            out[key] = (w / scale).astype(ml_dtypes.float8_e4m3fn)
            out[key + "_scale"] = scale if strategy == "channel" else scale.reshape(1)
        else:
            out[key] = w
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
        }},
        **config_changes,
    }
    (dst / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory):
    from hf_tiny import make_tiny

    path = tmp_path_factory.mktemp("quantize") / "float"
    make_tiny("llama3_scaled", path, seed=3)
    return path


def test_a_compressed_tensors_fp8_checkpoint_loads_as_the_same_weights_quantized_at_load(float_checkpoint):
    """RedHatAI-style FP8 (per channel) loads into the fp8 target that `--quantize fp8` makes from the float
    checkpoint: the same 8-bit values and scales, every parameter the same. Per-tensor scales load too."""
    from jaxspec.checkpoints.hf import load_target

    ct = float_checkpoint.parent / "fp8-channel"
    compressed_tensors_copy(float_checkpoint, ct)
    stored, at_load = load_target(ct), quantize_target(load_target(float_checkpoint), "fp8")
    assert stored.quantization == at_load.quantization == "fp8"
    for a, b in zip(quantized_linears(stored), quantized_linears(at_load)):
        assert bool(jnp.array_equal(a.kernel[...], b.kernel[...])) and bool(jnp.array_equal(a.scale[...], b.scale[...]))
    # every other parameter is read as for the float checkpoint, so the two are one model (its generation: above)
    for a, b in zip(jax.tree.leaves(nnx.state(stored, nnx.Param)), jax.tree.leaves(nnx.state(at_load, nnx.Param))):
        assert a.dtype == b.dtype and bool(jnp.array_equal(a, b))

    # `load_target(quantize=)` quantizes each kernel as it is read: the same model as quantizing it once loaded
    for mode, dtype in (("fp8", jnp.float32), ("int8", jnp.bfloat16)):
        whole = quantize_target(load_target(float_checkpoint, dtype=dtype), mode)
        read = load_target(float_checkpoint, dtype=dtype, quantize=mode)
        assert read.quantization == mode
        pairs = zip(jax.tree.leaves(nnx.state(read, nnx.Param)), jax.tree.leaves(nnx.state(whole, nnx.Param)),
                    strict=True)
        assert all(a.dtype == b.dtype and bool(jnp.array_equal(a, b)) for a, b in pairs)
    with pytest.raises(JaxspecError, match="is stored quantized \\(fp8\\); drop --quantize"):
        load_target(ct, quantize="int8")

    per_tensor = float_checkpoint.parent / "fp8-tensor"
    compressed_tensors_copy(float_checkpoint, per_tensor, strategy="tensor")
    scale = next(quantized_linears(load_target(per_tensor))).scale[...]
    assert scale.shape == (stored.config.hidden_size,) and bool(jnp.all(scale == scale[0]))


@pytest.mark.parametrize("changes, message", [  # CI: another method, and block scales; the rest -m slow
    ({"quant_method": "gptq", "format": None}, "jaxspec reads compressed-tensors float-quantized (FP8) checkpoints only"),
    pytest.param({"ignore": []}, "quantizes the LM head, which jaxspec does not read", marks=pytest.mark.slow),
    ({"config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "block"}}}},
     "jaxspec reads symmetric 8-bit float weights with a channel or tensor scale"),
    pytest.param({"config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                                          "input_activations": {"num_bits": 8, "type": "float", "dynamic": False}}}},
                 "static activation scales are not read", marks=pytest.mark.slow),
])
def test_quantized_checkpoints_jaxspec_does_not_read_are_one_line_errors(float_checkpoint, changes, message):
    from jaxspec.checkpoints.hf import load_target

    path = float_checkpoint.parent / f"bad-{abs(hash(message))}"
    compressed_tensors_copy(float_checkpoint, path, **changes)
    with pytest.raises(JaxspecError, match=re.escape(message)):
        load_target(path)


@pytest.mark.slow  # the int8 cases above run the same tiles; fp8 differs only in its values
def test_fp8_greedy_speculation_equals_fp8_target_only():
    target = quantize_target(nnx.merge(*nnx.split(in_dtype(tiny_target(), jnp.bfloat16))), "fp8")
    want = [c.token_ids for c in Generator(target, batch_size=1).generate(PROMPTS, max_new_tokens=30)]
    got = SpeculativeGenerator(target, fitted_head(), num_draft=5, batch_size=4).generate(PROMPTS, max_new_tokens=30)
    assert [c.token_ids for c in got] == want


def test_convert_refuses_a_quantized_checkpoint(float_checkpoint, tmp_path, capsys):
    from jaxspec import convert

    ct = tmp_path / "fp8"
    compressed_tensors_copy(float_checkpoint, ct)
    with pytest.raises(SystemExit) as exc:
        convert.main(["target", "--target", str(ct), "--out", str(tmp_path / "out")])
    assert exc.value.code == 2 and "is stored quantized (fp8); jaxspec converts float targets only" in capsys.readouterr().err


def test_quantization_drift_is_zero_against_itself_and_small_for_int8():
    from jaxspec.bench.drift import quantization_drift

    target = nnx.merge(*nnx.split(tiny_target()))
    target.numerics = None  # plain numerics: quick to compile, and the drift is the weights'
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
    same = quantization_drift(target, target, prompts)
    assert same["positions"] == sum(map(len, prompts)) and same["argmax_agreement"] == 1.0
    assert abs(same["next_token_kl"]) < 1e-6
    assert [a["layer"] for a in same["aux_layers"]] == list(target.config.aux_layer_ids)
    assert all(a["cosine"] > 1 - 1e-6 and a["relative_error"] < 1e-6 for a in same["aux_layers"])
    drift = quantization_drift(target, quantized(target), prompts)  # this target's embeddings dominate: small
    assert -1e-6 < drift["next_token_kl"] < 0.1 and drift["argmax_agreement"] > 0.8  # (KL ~0: rounding either way)
    assert all(0.99 < a["cosine"] <= 1 + 1e-6 and 0 < a["relative_error"] < 0.1 for a in drift["aux_layers"])


def test_a_bfloat16_training_copy_of_a_quantized_target_keeps_its_values_and_scales():
    """`target.quantize` with a bfloat16 training step (train/precision.py): the copy holds the same 8-bit values,
    keeps the float32 scales, and its features stay those of the float32 quantized target up to bfloat16."""
    from train.precision import computing_in
    from train.step import target_features

    target = quantized(tiny_target())
    target.numerics = None  # training runs the target with plain numerics
    narrow = computing_in(target, jnp.bfloat16)
    for wide, thin in zip(quantized_linears(target), quantized_linears(narrow), strict=True):
        assert thin.scale[...].dtype == jnp.float32 and bool(jnp.array_equal(thin.scale[...], wide.scale[...]))
        assert bool(jnp.array_equal(thin.kernel[...].astype(jnp.float32), wide.kernel[...].astype(jnp.float32)))
        assert thin.accumulate == jnp.float32
    ids = jnp.asarray([PROMPTS[0]])
    for want, got in zip(target_features(target, ids), target_features(narrow, ids), strict=True):
        want, got = np.asarray(want[0], np.float32), np.asarray(got[0], np.float32)  # [T, F]
        cosine = (want * got).sum(-1) / np.linalg.norm(want, axis=-1) / np.linalg.norm(got, axis=-1)
        assert got.dtype == np.float32 and cosine.min() > 0.999, cosine.min()


def test_bench_quantization_drift_needs_quantize(capsys):
    from jaxspec.bench import cli as bench

    with pytest.raises(SystemExit) as exc:
        bench.main(["--prompts-file", "x.jsonl", "--quantization-drift"])
    assert exc.value.code == 2 and "--quantization-drift compares a --quantize target" in capsys.readouterr().err
