"""The TTT forward and loss against a naive reference with explicit per-step masks over all keys."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.config import HeadConfig
from jaxspec.models.eagle3 import Eagle3Head
from train.ttt import ttt_hits, ttt_logits, ttt_logits_reference, ttt_loss

CFG = HeadConfig(
    hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48, vocab_size=50,
    draft_vocab_size=20, target_hidden_size=24,
)


# the last: a 3-layer head with EAGLE 3.1's switches (each layer its own keys; the normed state fed forward)
EAGLE31_MULTI = {"num_layers": 3, "norm_output": True, "fc_norm": True}
VARIANTS = [{}, {"norm_before_residual": True}, {"num_heads": 2, "num_kv_heads": 2, "head_dim": 16}, EAGLE31_MULTI]
EFFICIENT_CI = {(0, 9)}  # the plain head; the rest: -m slow (the 3-layer EAGLE 3.1 head trains in CI: test_ttt_steps_equal_inference_drafting)


@pytest.mark.parametrize("variant,t", [
    pytest.param(v, t, id=f"{t}-variant{i}", marks=() if (i, t) in EFFICIENT_CI else pytest.mark.slow)
    for t in (1, 9, 16) for i, v in enumerate(VARIANTS)
])
def test_efficient_attention_equals_explicit_masks(variant, t):
    cfg = HeadConfig(**{**CFG.__dict__, **variant})
    head = Eagle3Head(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(t)
    embed = jnp.asarray(rng.normal(size=(50, 32)), jnp.float32)
    feats = jnp.asarray(rng.normal(size=(2, t, 72)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 50, (2, t)), jnp.int32)
    fast = ttt_logits(head, embed, feats, ids, num_steps=4)
    slow = ttt_logits_reference(head, embed, feats, ids, num_steps=4)
    for a, b in zip(fast, slow):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-5)


def test_step_zero_equals_the_inference_forward():
    """Step 0 of TTT is what the head computes at inference over the same pairs (causal, own cache)."""
    head = Eagle3Head(CFG, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(0)
    embed = jnp.asarray(rng.normal(size=(50, 32)), jnp.float32)
    feats = jnp.asarray(rng.normal(size=(1, 12, 72)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 50, (1, 12)), jnp.int32)
    pos = jnp.arange(12, dtype=jnp.int32)[None]
    want, _, _ = head(ids, head.project(feats), pos, head.init_cache(1, 16), embed)
    np.testing.assert_allclose(np.asarray(ttt_logits(head, embed, feats, ids, 1)[0]), np.asarray(want), atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 0.0])
def test_loss_matches_a_direct_computation(temperature):
    rng = np.random.default_rng(3)
    b, t, k, vd, v = 2, 10, 3, 20, 50
    logits = [jnp.asarray(rng.normal(size=(b, t, vd)), jnp.float32) for _ in range(k)]
    target = jnp.asarray(rng.normal(size=(b, t, v)), jnp.float32)
    mask = jnp.asarray(rng.integers(0, 2, (b, t)), jnp.int32)
    draft_ids = jnp.asarray(np.sort(rng.choice(v, vd, replace=False)), jnp.int32)
    loss, metrics = ttt_loss(logits, target[..., draft_ids], mask, teacher_temperature=temperature)
    want = 0.0
    tgt = np.asarray(target)[..., np.asarray(draft_ids)]
    for step in range(k):
        num = den = 0.0
        for row in range(b):
            for pos in range(t):
                if pos + 2 + step < t and mask[row, pos + 2 + step]:
                    z = tgt[row, pos + 1 + step]
                    if temperature > 0:
                        p = np.exp((z - z.max()) / temperature)
                        p /= p.sum()
                    else:  # the teacher's greedy token alone
                        p = np.eye(vd)[np.argmax(z)]
                    logq = np.asarray(jax.nn.log_softmax(logits[step][row, pos]))
                    num += -(p * logq).sum()
                    den += 1
        want += 0.8**step * num / max(den, 1)
    assert float(loss) == pytest.approx(want, rel=1e-5)
    assert 1.0 <= float(metrics["tau"]) <= 1.0 + k


def test_loss_gradient_is_the_soft_cross_entropy_gradient():
    """The loss is computed as logsumexp(z) − Σ p·z (no log-probabilities materialized); its gradient must be the
    one of the textbook −Σ p·log_softmax(z)."""
    rng = np.random.default_rng(4)
    b, t, k, vd = 2, 12, 3, 20
    logits = [jnp.asarray(rng.normal(size=(b, t, vd)) * 3, jnp.float32) for _ in range(k)]
    teacher = jnp.asarray(rng.normal(size=(b, t, vd)) * 3, jnp.float32)
    mask = jnp.asarray(rng.integers(0, 2, (b, t)), jnp.int32)

    def textbook(logits):
        p = jax.nn.softmax(teacher, axis=-1)
        total = 0.0
        for step, z in enumerate(logits):
            at = jnp.arange(t) + 1 + step
            valid = (at + 1 < t) & (jnp.take(mask, jnp.minimum(at + 1, t - 1), axis=1) > 0)  # [B, T]
            ce = -jnp.sum(jnp.take(p, jnp.minimum(at, t - 1), axis=1) * jax.nn.log_softmax(z, axis=-1), axis=-1)
            total = total + 0.8**step * jnp.sum(ce * valid) / jnp.maximum(valid.sum(), 1)
        return total

    got = jax.grad(lambda z: ttt_loss(z, teacher, mask)[0])(logits)
    want = jax.grad(textbook)(logits)
    assert float(ttt_loss(logits, teacher, mask)[0]) == pytest.approx(float(textbook(logits)), rel=1e-5)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-6)


def test_accuracies_and_tau_match_a_direct_argmax_computation():
    """acc_k, cond_acc_k and the simulated τ, computed in the loss from row maxima and a top_k, against argmax
    written out; about half of the draft rows are made to agree with the teacher so that all metrics are non-trivial."""
    rng = np.random.default_rng(5)
    b, t, k, vd = 3, 16, 3, 24
    teacher = rng.normal(size=(b, t, vd)).astype(np.float32)
    logits = []
    for step in range(k):
        z = rng.normal(size=(b, t, vd)).astype(np.float32)
        best = teacher[:, np.minimum(np.arange(t) + 1 + step, t - 1)].argmax(-1)  # [B, T] the teacher's token
        agree = rng.random((b, t)) < 0.6
        rows, cols = np.nonzero(agree)
        z[rows, cols, best[rows, cols]] = z[rows, cols].max(-1) + 1.0
        logits.append(z)
    mask = rng.integers(0, 2, (b, t)).astype(np.int32)
    _, metrics = ttt_loss([jnp.asarray(z) for z in logits], jnp.asarray(teacher), jnp.asarray(mask))
    best = jnp.asarray(teacher.argmax(-1))  # [B, T] the teacher's token, as ttt_loss takes it
    hits, counted = (np.asarray(x) for x in ttt_hits([jnp.asarray(z) for z in logits], best, jnp.asarray(mask)))
    # a position whose token no draft can be (-1) is never right
    never, _ = ttt_hits([jnp.asarray(z) for z in logits], jnp.full_like(best, -1), jnp.asarray(mask))
    assert not np.asarray(never).any()
    still = np.ones((b, t), bool)
    tau, chain = 1.0, 1.0
    for step in range(k):
        at = np.arange(t) + 1 + step
        valid = (at + 1 < t)[None] & (mask[:, np.minimum(at + 1, t - 1)] > 0)  # [B, T]
        right = logits[step].argmax(-1) == teacher[:, np.minimum(at, t - 1)].argmax(-1)
        reached = still & valid
        np.testing.assert_array_equal(counted[step], valid)
        np.testing.assert_array_equal(hits[step] & valid, right & valid)  # held-out sums count what the loss does
        assert float(metrics[f"acc_{step}"]) == pytest.approx((right & valid).sum() / max(valid.sum(), 1), abs=1e-6)
        cond = (right & reached).sum() / max(reached.sum(), 1)
        assert float(metrics[f"cond_acc_{step}"]) == pytest.approx(cond, abs=1e-6)
        chain *= cond
        tau += chain
        still &= right
    assert 0.2 < float(metrics["acc_0"]) < 0.9
    assert float(metrics["tau"]) == pytest.approx(tau, abs=1e-5)


@pytest.mark.parametrize("variant", [{}, EAGLE31_MULTI], ids=["one-layer", "eagle31-3-layers"])
def test_ttt_steps_equal_inference_drafting(variant):
    """Step k, row t of TTT is exactly what the engine's head computes when drafting k tokens after anchor t
    (catch-up over the real pairs 0..t, then steps fed with its own state), given the same tokens."""
    from jaxspec.models import kv_cache as kvc

    head = Eagle3Head(HeadConfig(**{**CFG.__dict__, **variant}), rngs=nnx.Rngs(2))
    rng = np.random.default_rng(5)
    embed = jnp.asarray(rng.normal(size=(50, 32)), jnp.float32)
    t_len, steps = 12, 4
    feats = jnp.asarray(rng.normal(size=(1, t_len, 72)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 50, (1, t_len + steps)), jnp.int32)  # x_1 .. : the token after each position
    ttt = ttt_logits(head, embed, feats, ids[:, :t_len], steps)
    for anchor in (0, 5, 7):
        n = anchor + 1
        cache = head.init_cache(1, 32)
        pos = jnp.arange(n, dtype=jnp.int32)[None]
        logits, out, cache = head(ids[:, :n], head.project(feats[:, :n]), pos, cache, embed)
        cache = kvc.advance(cache, n)
        np.testing.assert_allclose(np.asarray(logits[0, -1]), np.asarray(ttt[0][0, anchor]), atol=1e-5)
        state = out[:, -1:]
        for k in range(1, steps):
            tok = ids[:, anchor + k : anchor + k + 1]  # x_{t+1+k}
            logits, out, cache = head(tok, state, cache.lengths[:, None], cache, embed)
            cache = kvc.advance(cache, 1)
            state = out
            np.testing.assert_allclose(np.asarray(logits[0, 0]), np.asarray(ttt[k][0, anchor]), atol=1e-5)


def _packed_case(rng, lengths, t, prompt=3):
    """Sequences of the given lengths packed back to back into one row of T, and the same sequences alone."""
    seqs = [rng.integers(0, 50, n) for n in lengths]
    feats = [rng.normal(size=(n, 72)) for n in lengths]
    ids = np.zeros((1, t), np.int32)
    f = np.zeros((1, t, 72), np.float32)
    pos, seg, mask = np.zeros((1, t), np.int32), np.zeros((1, t), np.int32), np.zeros((1, t), np.int32)
    start = 0
    for i, (s, g) in enumerate(zip(seqs, feats)):
        n = len(s)
        ids[0, start : start + n], f[0, start : start + n] = s, g
        pos[0, start : start + n], seg[0, start : start + n] = np.arange(n), i + 1
        mask[0, start + prompt : start + n] = 1
        start += n
    return seqs, feats, ids, f, pos, seg, mask


# CI: one sequence alone; several packed in a row: -m slow (and test_train_step's packed step equals the padded one)
@pytest.mark.parametrize("lengths,t", [pytest.param((7, 9), 16, marks=pytest.mark.slow),
                                       pytest.param((5, 4, 6), 20, marks=pytest.mark.slow), ((12,), 12)])
def test_packed_rows_equal_each_sequence_alone(lengths, t):
    """A row holding several sequences gives each the logits it gets alone (attention never crosses a boundary,
    positions restart), efficient form against the explicit-mask reference, on a subset of rows."""
    head = Eagle3Head(CFG, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(sum(lengths))
    embed = jnp.asarray(rng.normal(size=(50, 32)), jnp.float32)
    seqs, feats, ids, f, pos, seg, _ = _packed_case(rng, lengths, t)
    next_ids = np.concatenate([ids[:, 1:], np.zeros((1, 1), np.int32)], axis=1)
    at = np.sort(rng.choice(sum(lengths), size=max(1, sum(lengths) // 2), replace=False)).astype(np.int32)[None]
    args = (jnp.asarray(f), jnp.asarray(next_ids), 3, jnp.asarray(pos), jnp.asarray(seg), jnp.asarray(at))
    fast = ttt_logits(head, embed, *args)
    slow = ttt_logits_reference(head, embed, *args)
    for a, b in zip(fast, slow):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-5)
    start = 0
    for s, g in zip(seqs, feats):
        n = len(s)
        nxt = np.concatenate([ids[:, start + 1 : start + n + 1], np.zeros((1, max(0, start + n + 1 - t)), np.int32)], 1)
        alone = ttt_logits(head, embed, jnp.asarray(g[None], jnp.float32), jnp.asarray(nxt), 3)
        for k in range(3):
            for j, r in enumerate(at[0]):
                if start <= r < start + n - k - 1:  # x_{t+1+k} lies inside the sequence
                    np.testing.assert_allclose(
                        np.asarray(fast[k][0, j]), np.asarray(alone[k][0, r - start]), atol=2e-5, rtol=1e-5
                    )
        start += n


@pytest.mark.slow  # CI: test_train_step's packed step gives the padded step's loss and update
def test_packed_loss_equals_the_padded_batch():
    """The loss and metrics of packed rows (trained rows only) equal those of the same sequences padded one per
    row with every position computed: packing changes the cost, not the objective."""
    from train.packing import trained_positions

    head = Eagle3Head(CFG, rngs=nnx.Rngs(4))
    rng = np.random.default_rng(7)
    embed = jnp.asarray(rng.normal(size=(50, 32)), jnp.float32)
    lengths, t, steps = (9, 11), 24, 3
    _seqs, _feats, ids, f, pos, seg, mask = _packed_case(rng, lengths, t)
    teacher = rng.normal(size=(1, t, 20)).astype(np.float32)
    next_ids = np.concatenate([ids[:, 1:], np.zeros((1, 1), np.int32)], axis=1)
    trained = np.concatenate([trained_positions(mask[0, s : s + n], steps) + s
                              for s, n in zip((0, lengths[0]), lengths)])
    at = np.full((1, 16), t - 1, np.int32)
    at[0, : len(trained)] = trained
    logits = ttt_logits(head, embed, jnp.asarray(f), jnp.asarray(next_ids), steps, jnp.asarray(pos),
                        jnp.asarray(seg), jnp.asarray(at))
    packed, pm = ttt_loss(logits, jnp.asarray(teacher), jnp.asarray(mask), segments=jnp.asarray(seg),
                          trained=jnp.asarray(at))
    # the same two sequences, one per row, padded to the longer
    n = max(lengths)
    pid, pf = np.zeros((2, n + 1), np.int32), np.zeros((2, n, 72), np.float32)
    pmask, pteach = np.zeros((2, n), np.int32), np.zeros((2, n, 20), np.float32)
    start = 0
    for i, m in enumerate(lengths):
        pid[i, :m], pf[i, :m] = ids[0, start : start + m], f[0, start : start + m]
        pmask[i, :m], pteach[i, :m] = mask[0, start : start + m], teacher[0, start : start + m]
        start += m
    logits = ttt_logits(head, embed, jnp.asarray(pf), jnp.asarray(pid[:, 1:]), steps)
    padded, qm = ttt_loss(logits, jnp.asarray(pteach), jnp.asarray(pmask))
    assert float(packed) == pytest.approx(float(padded), rel=1e-5)
    for name in pm:
        assert float(pm[name]) == pytest.approx(float(qm[name]), rel=1e-5, abs=1e-6), name
