"""EAGLE-3 head checkpoints: the three published layouts load, mismatches are refused, exports round-trip."""

import dataclasses
import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from jaxspec.checkpoints.heads import detect_layout, export_head, load_head
from jaxspec.config import TargetConfig
from jaxspec.errors import JaxspecError

TARGET = TargetConfig(
    vocab_size=120, hidden_size=32, intermediate_size=64, num_layers=8, num_heads=4, num_kv_heads=2, head_dim=8
)
H, V, VD, I = 32, 120, 40, 48


def synthetic_tensors(layout: str, rng, with_embed=False) -> dict[str, np.ndarray]:
    """Tensors named, shaped and typed as the published heads are (bfloat16 weights, int64 d2t, bool t2d)."""
    bf16 = lambda *shape: rng.normal(0, 0.05, shape).astype(ml_dtypes.bfloat16)
    prefix = "layers.0." if layout == "speculators" else "midlayer."
    t = {
        "fc.weight": bf16(H, 3 * H),
        "norm.weight": (1 + bf16(H)).astype(ml_dtypes.bfloat16),
        "lm_head.weight": bf16(VD, H),
        prefix + "input_layernorm.weight": bf16(H),
        prefix + "hidden_norm.weight": bf16(H),
        prefix + "post_attention_layernorm.weight": bf16(H),
        prefix + "self_attn.q_proj.weight": bf16(4 * 8, 2 * H),
        prefix + "self_attn.k_proj.weight": bf16(2 * 8, 2 * H),
        prefix + "self_attn.v_proj.weight": bf16(2 * 8, 2 * H),
        prefix + "self_attn.o_proj.weight": bf16(H, 4 * 8),
        prefix + "mlp.gate_proj.weight": bf16(I, H),
        prefix + "mlp.up_proj.weight": bf16(I, H),
        prefix + "mlp.down_proj.weight": bf16(H, I),
    }
    selected = np.sort(rng.choice(V, VD, replace=False))
    t["d2t"] = (selected - np.arange(VD)).astype(np.int64)
    t2d = np.zeros(V, bool)
    t2d[selected] = True
    t["t2d"] = t2d
    if with_embed:
        t["embed_tokens.weight"] = bf16(V, H)
    return t


def synthetic_config(layout: str) -> dict:
    llama = dict(
        hidden_size=H, intermediate_size=I, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_hidden_layers=1, vocab_size=V, rms_norm_eps=1e-5, max_position_embeddings=2048, hidden_act="silu",
        model_type="llama", torch_dtype="bfloat16",
    )
    if layout == "eagle":  # EAGLE repo: flat Llama config, no rope_theta
        return {**llama, "architectures": ["LlamaForCausalLM"], "draft_vocab_size": VD}
    if layout == "sglang":
        return {
            **llama, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": VD, "rope_theta": 500000.0,
            "target_hidden_size": H, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]},
        }
    return {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "speculators_config": {"algorithm": "eagle3", "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                               "verifier": {"name_or_path": "meta-llama/Llama-3.1-8B-Instruct", "architectures": ["LlamaForCausalLM"]}},
        "transformer_layer_config": {**llama, "rope_theta": 500000.0, "architectures": ["LlamaForCausalLM"]},
        "draft_vocab_size": VD, "norm_before_residual": True, "target_hidden_size": H,
        "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
    }


def write(path, config, tensors):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("layout", ["eagle", "sglang", "speculators"])
def test_each_layout_loads(layout, tmp_path):
    tensors = synthetic_tensors(layout, np.random.default_rng(0), with_embed=layout == "speculators")
    path = write(tmp_path / layout, synthetic_config(layout), tensors)
    assert detect_layout(json.loads((path / "config.json").read_text())) == layout
    head = load_head(path, TARGET)
    cfg = head.config
    assert cfg.draft_vocab_size == VD and cfg.target_hidden_size == H
    assert cfg.aux_layer_ids == {"eagle": None, "sglang": (2, 4, 5), "speculators": (2, 4, 5)}[layout]
    assert cfg.norm_before_residual == (layout == "speculators")
    assert cfg.rope.theta == (10000.0 if layout == "eagle" else 500000.0)
    assert cfg.has_embed_tokens == (layout == "speculators")
    prefix = "layers.0." if layout == "speculators" else "midlayer."
    q = np.asarray(head.midlayer.self_attn.q_proj.kernel[...])
    np.testing.assert_array_equal(q, tensors[prefix + "self_attn.q_proj.weight"].astype(np.float32).T)
    np.testing.assert_array_equal(np.asarray(head.d2t[...]), tensors["d2t"])
    ids = np.asarray(head.to_target_ids(jnp.arange(VD)))
    assert np.array_equal(np.flatnonzero(tensors["t2d"]), ids)


def _mutate(layout, tmp_path, config_change=None, tensor_change=None, name="bad"):
    config = synthetic_config(layout)
    tensors = synthetic_tensors(layout, np.random.default_rng(1))
    if config_change:
        config_change(config)
    if tensor_change:
        tensor_change(tensors)
    return write(tmp_path / name, config, tensors)


@pytest.mark.parametrize(
    "layout, config_change, tensor_change, message",
    [
        ("sglang", lambda c: c.update(hidden_size=48), None, "draft head hidden size 48 != target hidden size 32"),
        ("sglang", lambda c: c.update(target_hidden_size=64), None, "expects target hidden size 64, the target has 32"),
        ("eagle", lambda c: c.update(vocab_size=128), None, "draft head vocabulary 128 != target vocabulary 120"),
        ("sglang", lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 3, 8]), None,
         "reads target layer 9"),
        ("speculators", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 4, 8]), None, "reads target layer 8"),
        ("eagle", None, lambda t: t.pop("midlayer.mlp.up_proj.weight"), "lacks tensors midlayer.mlp.up_proj.weight"),
        ("eagle", None, lambda t: t.update({"midlayer.extra.weight": np.zeros(3, np.float32)}),
         "unexpected tensors midlayer.extra.weight"),
        ("sglang", None, lambda t: t.pop("d2t"), "lacks the d2t tensor"),
        ("eagle", None, lambda t: t.update({"fc.weight": np.zeros((H, 2 * H), np.float32)}),
         r"tensor 'fc.weight' has shape \(32, 64\), but its config implies \(32, 96\)"),
    ],
)
def test_mismatches_are_refused(layout, config_change, tensor_change, message, tmp_path):
    path = _mutate(layout, tmp_path, config_change, tensor_change)
    with pytest.raises(JaxspecError, match=message):
        load_head(path, TARGET)


def test_pickled_weights_need_opt_in(tmp_path):
    torch = pytest.importorskip("torch")
    tensors = synthetic_tensors("eagle", np.random.default_rng(2))
    path = tmp_path / "bin"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(synthetic_config("eagle")))
    torch.save({k: torch.from_numpy(v.astype(np.float32) if v.dtype == ml_dtypes.bfloat16 else v) for k, v in tensors.items()},
               path / "pytorch_model.bin")
    with pytest.raises(JaxspecError, match="pass --allow-pickle"):
        load_head(path, TARGET)
    head = load_head(path, TARGET, allow_pickle=True)
    np.testing.assert_array_equal(np.asarray(head.d2t[...]), tensors["d2t"])


def test_not_a_head(tmp_path):
    path = write(tmp_path / "plain", {"architectures": ["LlamaForCausalLM"], "hidden_size": 8}, {"x": np.zeros(1)})
    with pytest.raises(JaxspecError, match="does not describe an EAGLE-3 head"):
        load_head(path, TARGET)
    with pytest.raises(JaxspecError, match="does not exist"):
        load_head(tmp_path / "nope", TARGET)


@pytest.mark.parametrize("source", ["eagle", "speculators"])
@pytest.mark.parametrize("layout", ["speculators", "sglang", "eagle"])
def test_export_round_trip(source, layout, tmp_path):
    tensors = synthetic_tensors(source, np.random.default_rng(3))
    head = load_head(write(tmp_path / "src", synthetic_config(source), tensors), TARGET)
    out = export_head(head, tmp_path / "out", layout=layout, target=TARGET, dtype="float32")
    back = load_head(out, TARGET)
    assert detect_layout(json.loads((out / "config.json").read_text())) == layout
    # Both read the target's default layers; the EAGLE layout leaves them unnamed, the others name them.
    aux = None if layout == "eagle" else TARGET.aux_layer_ids
    assert back.config == dataclasses.replace(head.config, aux_layer_ids=aux)
    for (pa, a), (pb, b) in zip(nnx.iter_graph(head), nnx.iter_graph(back)):
        if isinstance(a, nnx.Variable):
            assert pa == pb
            np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]))


def test_the_eagle_layout_refuses_heads_reading_other_layers(tmp_path):
    head = load_head(write(tmp_path / "src", synthetic_config("speculators"), synthetic_tensors("speculators",
                                                                                              np.random.default_rng(0))), TARGET)
    head.config = dataclasses.replace(head.config, aux_layer_ids=(1, 2, 3))
    with pytest.raises(JaxspecError, match=r"reads \(1, 2, 3\) instead of the default \(2, 4, 5\).*'sglang'"):
        export_head(head, tmp_path / "out", layout="eagle", target=TARGET)


def multi_layer_head(rng, layers: int) -> tuple[dict, dict[str, np.ndarray]]:
    """A speculators-layout EAGLE 3.1 head of `layers` decoder layers (vLLM's multi-layer form: layers.0 reads
    2H, layers.1.. are plain Llama layers), fc_norm and norm_output on; float32, norms away from 1."""
    config = synthetic_config("speculators")
    config["transformer_layer_config"]["num_hidden_layers"] = layers
    config |= {"fc_norm": True, "norm_output": True, "norm_before_residual": False}
    tensors = {k: v.astype(np.float32) for k, v in synthetic_tensors("speculators", rng).items() if k != "t2d"}
    tensors["d2t"] = synthetic_tensors("speculators", np.random.default_rng(9))["d2t"]
    w = lambda *shape: rng.normal(0, 0.2, shape).astype(np.float32)  # noqa: E731
    norm = lambda n: (1 + 0.2 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    for k in [k for k in tensors if k.endswith("norm.weight")]:
        tensors[k] = norm(H)
    tensors |= {f"fc_norm.{i}.weight": norm(H) for i in range(3)}
    for layer in range(1, layers):
        p = f"layers.{layer}."
        tensors |= {
            p + "input_layernorm.weight": norm(H), p + "post_attention_layernorm.weight": norm(H),
            p + "self_attn.q_proj.weight": w(4 * 8, H), p + "self_attn.k_proj.weight": w(2 * 8, H),
            p + "self_attn.v_proj.weight": w(2 * 8, H), p + "self_attn.o_proj.weight": w(H, 4 * 8),
            p + "mlp.gate_proj.weight": w(I, H), p + "mlp.up_proj.weight": w(I, H), p + "mlp.down_proj.weight": w(H, I),
        }
    return config, tensors


def reference_head(W: dict, layers: int, embed, feats, tokens, extra_token) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's multi-layer EAGLE-3 forward with EAGLE 3.1's switches (BLOCK_DRAFTERS.md §3.3, §4) in numpy float64:
    the catch-up over T pairs (tokens[t], fc(fc_norm(features[t]))), then one draft step whose state is the normed
    output of the last pair (norm_output) at position T; both in one causal pass (the same keys a cache holds).
    → (logits of the last pair [V_d], logits of the draft step [V_d])."""
    eps, d, hq, hkv, theta = 1e-5, 8, 4, 2, 500000.0
    W = {k: v.astype(np.float64) for k, v in W.items()}
    rms = lambda x, wt: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * wt  # noqa: E731

    def rope(x, pos):  # x [T, heads, d]
        inv = 1.0 / (theta ** (np.arange(0, d, 2) / d))
        ang = np.concatenate([pos[:, None] * inv, pos[:, None] * inv], -1)[:, None, :]
        return x * np.cos(ang) + np.concatenate([-x[..., d // 2:], x[..., : d // 2]], -1) * np.sin(ang)

    def layer(p, u, residual, pos):
        n = len(u)
        q = rope((u @ W[p + "self_attn.q_proj.weight"].T).reshape(n, hq, d), pos)
        k = rope((u @ W[p + "self_attn.k_proj.weight"].T).reshape(n, hkv, d), pos)
        v = (u @ W[p + "self_attn.v_proj.weight"].T).reshape(n, hkv, d)
        s = np.einsum("thd,shd->hts", q, np.repeat(k, hq // hkv, axis=1)) / np.sqrt(d)
        s = np.where(np.tril(np.ones((n, n), bool))[None], s, -np.inf)
        probs = np.exp(s - s.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        att = np.einsum("hts,shd->thd", probs, np.repeat(v, hq // hkv, axis=1)).reshape(n, hq * d)
        y = residual + att @ W[p + "self_attn.o_proj.weight"].T
        yn = rms(y, W[p + "post_attention_layernorm.weight"])
        gate, up = yn @ W[p + "mlp.gate_proj.weight"].T, yn @ W[p + "mlp.up_proj.weight"].T
        return y + (gate / (1 + np.exp(-gate)) * up) @ W[p + "mlp.down_proj.weight"].T

    def run(token_ids, states):
        pos = np.arange(len(token_ids), dtype=np.float64)
        emb = embed[token_ids].astype(np.float64)
        u = np.concatenate([rms(emb, W["layers.0.input_layernorm.weight"]),
                            rms(states, W["layers.0.hidden_norm.weight"])], -1)
        x = layer("layers.0.", u, states, pos)
        for i in range(1, layers):
            x = layer(f"layers.{i}.", rms(x, W[f"layers.{i}.input_layernorm.weight"]), x, pos)
        normed = rms(x, W["norm.weight"])
        return normed @ W["lm_head.weight"].T, normed

    chunks = np.split(feats.astype(np.float64), 3, axis=-1)
    states = np.concatenate([rms(c, W[f"fc_norm.{i}.weight"]) for i, c in enumerate(chunks)], -1) @ W["fc.weight"].T
    logits, normed = run(tokens, states)
    step, _ = run(np.append(tokens, extra_token), np.concatenate([states, normed[-1:]]))  # norm_output: the normed
    return logits[-1], step[-1]


def test_a_multi_layer_eagle31_head_drafts_as_vllm_describes(tmp_path):
    """A 3-layer speculators head with fc_norm and norm_output: the catch-up's logits and a draft step fed the
    normed state equal the numpy reference; exported in each layout it loads back the same."""
    from jaxspec.models import kv_cache as kvc

    rng = np.random.default_rng(7)
    config, tensors = multi_layer_head(rng, layers=3)
    head = load_head(write(tmp_path / "src", config, tensors), TARGET)
    cfg = head.config
    assert (cfg.num_layers, cfg.fc_norm, cfg.norm_output) == (3, True, True) and len(head.later_layers) == 2
    embed = rng.normal(0, 0.5, (V, H)).astype(np.float32)
    feats = rng.normal(0, 1.0, (6, 3 * H)).astype(np.float32)
    tokens = rng.integers(0, V, 6)
    want_last, want_step = reference_head(tensors, 3, embed, feats, tokens, extra_token=11)

    pos = jnp.arange(6, dtype=jnp.int32)[None]
    logits, state, cache = head(jnp.asarray(tokens[None], jnp.int32), head.project(jnp.asarray(feats[None])), pos,
                                head.init_cache(1, 16), jnp.asarray(embed))
    assert len(cache.k) == 3
    np.testing.assert_allclose(np.asarray(logits[0, -1]), want_last, rtol=2e-4, atol=2e-4)
    cache = kvc.advance(cache, 6)
    step, _, _ = head(jnp.asarray([[11]], jnp.int32), state[:, -1:], cache.lengths[:, None], cache, jnp.asarray(embed))
    np.testing.assert_allclose(np.asarray(step[0, 0]), want_step, rtol=2e-4, atol=2e-4)

    for layout in ("speculators", "sglang", "eagle"):
        out = export_head(head, tmp_path / layout, layout=layout, target=TARGET, dtype="float32")
        written = json.loads((out / "config.json").read_text())
        layer_config = written.get("transformer_layer_config", written)
        assert layer_config["num_hidden_layers"] == 3 and written["norm_output"] and written["fc_norm"]
        back = load_head(out, TARGET)
        assert (back.config.num_layers, back.config.norm_output) == (3, True)
        for (pa, a), (pb, b) in zip(nnx.iter_graph(head), nnx.iter_graph(back)):
            if isinstance(a, nnx.Variable):
                assert pa == pb
                np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]))


def test_a_multi_layer_head_missing_a_layer_is_refused(tmp_path):
    config, tensors = multi_layer_head(np.random.default_rng(8), layers=2)
    del tensors["layers.1.mlp.up_proj.weight"]
    with pytest.raises(JaxspecError, match=r"lacks tensors layers\.1\.mlp\.up_proj\.weight"):
        load_head(write(tmp_path / "h", config, tensors), TARGET)


def test_a_peagle_head_loads_and_exports_in_each_layout(tmp_path):
    """P-EAGLE (parallel drafting): speculators_model_type 'peagle' with mask_token_id, and SpecForge's
    [1, 1, 3H] mask_hidden; exported in each layout (speculators' mask_token_id, the others' pard_token) it loads
    back the same. A mask_hidden without a token, or a P-EAGLE config without mask_hidden, is a one-line error."""
    config = synthetic_config("speculators") | {"speculators_model_type": "peagle", "mask_token_id": 11}
    tensors = synthetic_tensors("speculators", np.random.default_rng(4))
    tensors["mask_hidden"] = np.random.default_rng(5).normal(size=(1, 1, 3 * H)).astype(np.float32)
    head = load_head(write(tmp_path / "src", config, tensors), TARGET)
    assert head.config.mask_token_id == 11
    np.testing.assert_array_equal(np.asarray(head.mask_hidden[...]), tensors["mask_hidden"][0])
    for layout in ("speculators", "sglang", "eagle"):
        back = load_head(export_head(head, tmp_path / layout, layout=layout, target=TARGET, dtype="float32"), TARGET)
        assert back.config.mask_token_id == 11
        np.testing.assert_array_equal(np.asarray(back.mask_hidden[...]), np.asarray(head.mask_hidden[...]))
    plain = {k: v for k, v in config.items() if k != "mask_token_id"} | {"speculators_model_type": "eagle3"}
    with pytest.raises(JaxspecError, match="has P-EAGLE's mask_hidden but its config names no parallel-drafting"):
        load_head(write(tmp_path / "no-token", plain, tensors), TARGET)
    del tensors["mask_hidden"]
    with pytest.raises(JaxspecError, match="lacks tensors mask_hidden"):
        load_head(write(tmp_path / "no-mask", config, tensors), TARGET)
