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

from jaxspec.config import HeadConfig
from jaxspec.engine.generation import Generator
from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.models.llama import LlamaModel
from jaxspec.sampling import SamplingConfig


def head_config_for(target: LlamaModel, **overrides) -> HeadConfig:
    # the default RoPE (not the target's), as the fitted test heads were made
    defaults = {"intermediate_size": 2 * target.config.hidden_size, "rope": HeadConfig.rope}
    return HeadConfig.for_target(target.config, **{**defaults, **overrides})


def fit_head(target: LlamaModel, steps: int = 300, seed: int = 0, seq_len: int = 48, n_seqs: int = 64) -> Eagle3Head:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, target.config.vocab_size, 4).tolist() for _ in range(n_seqs)]
    gen = Generator(target, batch_size=16).generate(
        prompts, max_new_tokens=seq_len - 4, sampling=SamplingConfig(temperature=1.0), seed=seed
    )
    seqs = jnp.asarray([p + c.token_ids for p, c in zip(prompts, gen)], jnp.int32)  # [N, L]
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
