"""Fit an EAGLE-3 head to a tiny target for a few seconds, so that engine tests see real multi-token acceptance.

Step-0 training only (the head reads the target's features g_t and token x_{t+1} and learns the target's next
token), on continuations the target samples itself; the trainer proper (TTT) belongs to `train/`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxspec.config import DFlashConfig, HeadConfig, RopeConfig
from jaxspec.models.dflash import DFlashDrafter
from jaxspec.engine.generation import Generator
from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.models.llama import LlamaModel
from jaxspec.sampling import SamplingConfig


def head_config_for(target: LlamaModel, **overrides) -> HeadConfig:
    # the default RoPE (not the target's), as the fitted test heads were made
    defaults = {"intermediate_size": 2 * target.config.hidden_size, "rope": HeadConfig.rope}
    return HeadConfig.for_target(target.config, **{**defaults, **overrides})


def sampled_sequences(target: LlamaModel, seed: int, seq_len: int, n_seqs: int, temperature: float = 1.0) -> jax.Array:
    """[N, L] continuations the target generates itself from random 4-token prompts (the prompts included)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, target.config.vocab_size, 4).tolist() for _ in range(n_seqs)]
    gen = Generator(target, batch_size=16).generate(
        prompts, max_new_tokens=seq_len - 4, sampling=SamplingConfig(temperature=temperature), seed=seed
    )
    return jnp.asarray([p + c.token_ids for p, c in zip(prompts, gen)], jnp.int32)


def fit_head(target: LlamaModel, steps: int = 300, seed: int = 0, seq_len: int = 48, n_seqs: int = 64) -> Eagle3Head:
    seqs = sampled_sequences(target, seed, seq_len, n_seqs)  # [N, L]
    n, length = seqs.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (n, length))

    @nnx.jit
    def features(target, seqs, positions):  # one compiled forward, not hundreds of eager ops
        out = target(seqs, positions, target.init_cache(n, length), return_aux=True)
        return jnp.argmax(out.logits, -1), out.aux

    labels, aux = features(target, seqs, positions)  # labels [N, L]: the target's choice after each token
    feats = aux[:, :-2]  # pair t = (g_t, x_{t+1}) predicts labels[t+1]; its second step reads x_{t+2}
    tok1, lab1, tok2, lab2 = seqs[:, 1:-1], labels[:, 1:-1], seqs[:, 2:], labels[:, 2:]
    embed = target.embed_tokens[...]

    head = Eagle3Head(head_config_for(target), rngs=nnx.Rngs(seed))
    opt = nnx.Optimizer(head, optax.adam(3e-3), wrt=nnx.Param)
    graphdef, state = nnx.split((head, opt))

    def loss_fn(head, idx):
        # Two draft steps: the second feeds the head's own state back, as drafting does (its attention is
        # simplified to causal over the second step's own keys: good enough for a test fixture).
        b, t = tok1[idx].shape
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        logits1, hstate, _ = head(tok1[idx], head.project(feats[idx]), pos, head.init_cache(b, t), embed)
        logits2, _, _ = head(tok2[idx], hstate, pos + 1, head.init_cache(b, t), embed)
        ce = optax.softmax_cross_entropy_with_integer_labels
        return ce(logits1, lab1[idx]).mean() + 0.8 * ce(logits2, lab2[idx]).mean()

    @jax.jit
    def train(state, batches):  # all steps in one program: a Python loop of nnx.jit calls spends ~45 ms a step
        def step(state, idx):
            head, opt = nnx.merge(graphdef, state)
            loss, grads = nnx.value_and_grad(loss_fn)(head, idx)
            opt.update(head, grads)
            return nnx.state((head, opt)), loss

        return jax.lax.scan(step, state, batches)[0]

    key = np.random.default_rng(seed + 1)
    batches = jnp.asarray(np.stack([key.choice(n, 16, replace=False) for _ in range(steps)]))  # [steps, 16]
    nnx.update((head, opt), train(state, batches))
    return head


def dflash_config_for(target: LlamaModel, **overrides) -> DFlashConfig:
    """A 2-layer drafter with blocks of 4 (3 drafts) reading the outputs of the layers whose inputs are the tiny
    target's default features (so one target serves EAGLE-3 and DFlash tests)."""
    ids = tuple(i - 1 for i in target.config.aux_layer_ids)
    base = dict(num_layers=2, block_size=4, target_layer_ids=ids, intermediate_size=2 * target.config.hidden_size,
                mask_token_id=target.config.vocab_size - 1, rope=RopeConfig(theta=10000.0))
    return DFlashConfig.for_target(target.config, **{**base, **overrides})


def fit_dflash(target: LlamaModel, steps: int = 300, seed: int = 0, seq_len: int = 48, n_seqs: int = 64,
               **overrides) -> DFlashDrafter:
    """A DFlash drafter fitted to a tiny target with the training objective (`train.dflash.block_loss`) on the
    target's own greedy continuations (self-distilled, as DFlash drafters are trained: a block's labels are the
    tokens themselves, and the tiny target's samples are near-uniform), every position an anchor, all steps in one
    scanned program."""
    from train.dflash import block_loss

    seqs = sampled_sequences(target, seed, seq_len, n_seqs, temperature=0.0)  # [N, L]
    n, length = seqs.shape

    @nnx.jit
    def features(target, seqs):
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (n, length))
        return target(seqs, positions, target.init_cache(n, length), return_aux=True).aux

    feats = features(target, seqs)  # [N, L, F]
    anchors = jnp.broadcast_to(jnp.arange(length - 1, dtype=jnp.int32), (16, length - 1))
    loss_mask = jnp.ones((16, length), jnp.int32)
    drafter = DFlashDrafter(dflash_config_for(target, **overrides), rngs=nnx.Rngs(seed))
    opt = nnx.Optimizer(drafter, optax.adam(3e-3), wrt=nnx.Param)
    graphdef, state = nnx.split((drafter, opt))
    frozen = nnx.clone(target)
    frozen.numerics = None  # the objective needs values, not the verifier's bits

    @jax.jit
    def train(state, batches):
        def step(state, idx):
            drafter, opt = nnx.merge(graphdef, state)
            def loss_fn(drafter):  # the frozen target is a constant of the program, not an argument
                return block_loss(drafter, frozen, feats[idx], seqs[idx], loss_mask, anchors, gamma=4.0)[0]

            loss, grads = nnx.value_and_grad(loss_fn)(drafter)
            opt.update(drafter, grads)
            return nnx.state((drafter, opt)), loss

        return jax.lax.scan(step, state, batches)

    key = np.random.default_rng(seed + 1)
    batches = jnp.asarray(np.stack([key.choice(n, 16, replace=False) for _ in range(steps)]))  # [steps, 16]
    nnx.update((drafter, opt), train(state, batches)[0])
    return drafter
