"""Teacher-forced acceptance of a head on held-out sequences: python -m train.heldout --draft DIR --data DIR ...

The engine's evaluation (train.launch `eval_every`) drafts and verifies for real, which on a 2-core CPU affords a
few prompts × 64 tokens: its mean accepted length moves by a few hundredths from one evaluation to the next on
noise alone. Here every response position of every held-out sequence (e.g. the target's greedy responses to all 80
MT-Bench prompts, written by `python -m train.data generate --prompts mt_bench`) is drafted as the TTT step drafts
it — the head's own state fed forward, the true tokens as inputs — and step k is right where its greedy draft is
the token the target produced there (outside the draft vocabulary, never). From those per-position runs of right
drafts, greedy chain drafting is replayed verify step by verify step (`replay_chain`): on 8 MT-Bench prompts it
gave the engine's own count (766 verify steps, the same acceptance per position; BENCHMARKS.md), at a few seconds
per thousand tokens instead of ~25 s per prompt.

A DFlash block drafter (`--draft` naming z-lab's layout) is replayed the same way: its drafts at an anchor depend
only on the context before it and the anchor token (a block's slots never see each other's outputs), so every
response position's block is drafted teacher-forced, in chunks of anchors per forward (`train.dflash.block_logits`,
the objective's own forward, tested equal to drafting one block at a time), and its runs of right drafts are
replayed as the engine would accept them (`block_heldout_acceptance`).
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.errors import JaxspecError
from train.dflash import block_logits
from train.packing import PackedBatches, layout
from train.step import target_features
from train.ttt import ttt_hits, ttt_logits

ROWS = 4  # packed rows per evaluated batch
ROW_LEN = 512
ANCHORS = 32  # a DFlash drafter's blocks per row and forward: 4 rows x 32 blocks x 8 slots of float32 logits over
# SmolLM2's 49,152 tokens are 200 MB


@functools.partial(jax.jit, static_argnames=("target_graphdef", "head_graphdef", "num_steps"))
def _hits(target_graphdef, target_state, head_graphdef, head_state, ids, loss_mask, positions, segments, trained, *,
          num_steps: int):
    """For one batch ([B, T] each, trained [B, C]): the per-step sums (right, counted, chained, reached) [4, K] and
    how many drafts a chain anchored at each trained row gets accepted [B, C]. The models come in as graphdefs
    (static) and states (arguments), not closed over: weights as traced constants made XLA constant-fold them, and a
    launcher evaluating every N steps recompiles nothing."""
    target = nnx.merge(target_graphdef, target_state)
    head = nnx.merge(head_graphdef, head_state)
    vd = head.config.draft_vocab_size
    draft_ids = head.to_target_ids(jnp.arange(vd, dtype=jnp.int32))  # [V_d] target ids
    to_draft = jnp.full((target.config.vocab_size,), -1, jnp.int32).at[draft_ids].set(jnp.arange(vd))
    features, _ = target_features(target, ids, positions, segments)
    next_ids = jnp.concatenate([ids[:, 1:], jnp.zeros_like(ids[:, :1])], axis=1)
    # the token the target produced after each position (the data are its greedy output: what the engine verifies),
    # as a draft id; -1 outside the draft vocabulary, where every draft is rejected
    best = jnp.take(to_draft, next_ids)  # [B, T]
    logits = ttt_logits(head, target.embed_tokens[...], features.astype(head.dtype), next_ids, num_steps,
                        positions, segments, trained)
    right, counted = ttt_hits(logits, best, loss_mask, segments, trained)  # [K, B, C] each
    chain = jnp.cumprod(right, axis=0).astype(bool)  # steps 0..k all right
    reached = jnp.concatenate([jnp.ones_like(chain[:1]), chain[:-1]], axis=0) & counted
    sums = (jnp.sum(right & counted, axis=(1, 2)), jnp.sum(counted, axis=(1, 2)),
            jnp.sum(chain & reached, axis=(1, 2)), jnp.sum(reached, axis=(1, 2)))
    runs = jnp.sum(jnp.cumprod(right & counted, axis=0), axis=0)  # [B, C] drafts a chain from here accepts
    return jnp.stack(sums), runs


def heldout_acceptance(target, head, sequences, num_steps: int) -> dict:
    """Teacher-forced acceptance of `head` drafting `num_steps` tokens on (ids, loss_mask) sequences: per step the
    accuracy and the conditional acceptance (right given every earlier step was right), the chain length they
    imply (tau), and chain_k: greedy chain drafting of k ≤ num_steps tokens replayed. The head and target compute
    in their own dtypes (evaluate as generation would run them)."""
    sequences = [s[:2] for s in sequences]
    if not sequences:
        raise JaxspecError("the held-out shards hold no sequences")
    longest = max(len(s[0]) for s in sequences)
    row_len = max(ROW_LEN, 1 << int(np.ceil(np.log2(longest))))  # one row holds the longest: nothing is cut
    batches = PackedBatches(sequences, row_len, ROWS, num_steps, seed=0)
    steps = -(-len(batches.epoch_rows(0)) // ROWS)
    tgd, tstate = nnx.split(target)
    hgd, hstate = nnx.split(head)
    hits = functools.partial(_hits, tgd, tstate, hgd, hstate, num_steps=num_steps)

    totals = np.zeros((4, num_steps), np.int64)
    runs = [np.zeros(len(s[0]), np.int64) for s in sequences]  # per sequence and position
    rows = batches.epoch_rows(0)
    for step in range(steps):
        b = batches(step)
        keep = min(ROWS, len(rows) - step * ROWS)  # the last batch wraps into epoch 1: drop the repeats
        b.segments[keep:] = 0
        b.loss_mask[keep:] = 0
        sums, found = hits(b.ids, b.loss_mask, b.positions, b.segments, b.trained)
        totals += np.asarray(sums)
        found = np.asarray(found)
        for r, members in enumerate(rows[step * ROWS : step * ROWS + keep]):
            for _, i, start, n in layout(members, batches.lengths):
                inside = (b.trained[r] >= start) & (b.trained[r] < start + n)
                runs[i][b.trained[r][inside] - start] = found[r][inside]
    return scores(totals, sequences, runs)


def scores(totals: np.ndarray, sequences, runs) -> dict:
    """The result of a replay from its per-step sums totals [4, K] (right, counted, chained, reached) and the runs
    of right drafts per sequence and position: the rates, tau and every chain_k up to K replayed."""
    right, counted, chained, reached = totals
    num_steps = totals.shape[1]
    cond = chained / np.maximum(reached, 1)
    longest_chain = replay_chain(sequences, runs, num_steps)
    return {
        "positions": int(counted[0]),
        "accuracy": [round(float(x), 4) for x in right / np.maximum(counted, 1)],
        "conditional_acceptance": [round(float(x), 4) for x in cond],
        # 1 + Σ_k Π_{i≤k} cond_i, as the training metrics' `tau`: over all positions, above the engine's (chain_K)
        "tau": round(float(1 + np.cumprod(cond).sum()), 4),
        **{f"chain_{k}": round(replay_chain(sequences, runs, k)[0], 4) for k in range(1, num_steps)},
        f"chain_{num_steps}": round(longest_chain[0], 4),
        f"chain_{num_steps}_acceptance_per_position": longest_chain[1],
        "sequences": len(sequences),
    }


@functools.partial(jax.jit, static_argnames=("target_graphdef",))
def _context_features(target_graphdef, target_state, ids):
    """The target's features at the drafter's layers [N, S, n_aux * H] of right-padded rows ids [N, S] (causal: the
    padding after a row's tokens changes none of them)."""
    return target_features(nnx.merge(target_graphdef, target_state), ids)[0]


@functools.partial(jax.jit, static_argnames=("target_graphdef", "drafter_graphdef", "num_steps"))
def _block_drafts(target_graphdef, target_state, drafter_graphdef, drafter_state, features, ids, anchors, *,
                  num_steps: int):
    """[N, A, K] the greedy drafts of slots 1..K of each anchor's block (anchors [N, A] int32 < S)."""
    target = nnx.merge(target_graphdef, target_state)
    drafter = nnx.merge(drafter_graphdef, drafter_state)
    logits, _ = block_logits(drafter, target, features, ids, anchors)  # [N, A, B, V]
    return jnp.argmax(logits[:, :, 1 : num_steps + 1], axis=-1).astype(jnp.int32)


def block_heldout_acceptance(target, drafter, sequences, num_steps: int) -> dict:
    """`heldout_acceptance` for a DFlash block drafter drafting chains of `num_steps` <= block_size - 1 tokens: at
    every anchor x_j of a response (j from its first token, which the prefill emits, to its second-to-last) the
    block's greedy drafts of x_{j+1} .. x_{j+K}, right where they are the data's tokens. Step k's accuracy counts
    the anchors whose x_{j+k} is a response token; a chain accepts the drafts in a row that are right (the same
    keys as `heldout_acceptance`). One sequence per row (a block must not see another's text as context)."""
    cfg = drafter.config
    if not 1 <= num_steps <= cfg.block_size - 1:
        raise JaxspecError(f"a DFlash drafter with blocks of {cfg.block_size} drafts 1 to {cfg.block_size - 1} "
                           f"tokens per step; got {num_steps}")
    sequences = [s[:2] for s in sequences]
    if not sequences:
        raise JaxspecError("the held-out shards hold no sequences")
    longest = max(len(s[0]) for s in sequences)
    row_len = max(ROW_LEN, 1 << int(np.ceil(np.log2(longest))))
    tgd, tstate = nnx.split(target)
    dgd, dstate = nnx.split(drafter)
    k = num_steps
    totals = np.zeros((4, k), np.int64)  # right, counted, chained, reached per step
    runs = [np.zeros(len(s[0]), np.int64) for s in sequences]
    for first in range(0, len(sequences), ROWS):
        group = sequences[first : first + ROWS]
        ids = np.zeros((ROWS, row_len), np.int32)
        anchors = []  # per row: the anchors j (x_j the root, x_{j+1} a response token)
        for r, (tokens, mask) in enumerate(group):
            ids[r, : len(tokens)] = tokens
            j = int(np.argmax(mask > 0))
            anchors.append(np.arange(j, len(tokens) - 1) if mask[j] and j > 0 else np.zeros(0, np.int64))
        features = _context_features(tgd, tstate, ids)
        drafted = [np.zeros((len(a), k), np.int32) for a in anchors]
        for c in range(0, max(len(a) for a in anchors), ANCHORS):
            chunk = np.zeros((ROWS, ANCHORS), np.int32)  # padding anchors draft at 0 and are dropped
            for r, a in enumerate(anchors):
                chunk[r, : len(a[c : c + ANCHORS])] = a[c : c + ANCHORS]
            got = np.asarray(_block_drafts(tgd, tstate, dgd, dstate, features, ids, chunk, num_steps=k))
            for r, a in enumerate(anchors):
                drafted[r][c : c + ANCHORS] = got[r, : len(a[c : c + ANCHORS])]
        for r, (tokens, mask) in enumerate(group):
            n = len(tokens)
            for j, drafts in zip(anchors[r], drafted[r]):
                at = j + 1 + np.arange(k)
                counted = (at < n) & (mask[np.minimum(at, n - 1)] > 0)
                right = counted & (drafts == tokens[np.minimum(at, n - 1)])
                chain = np.cumprod(right).astype(bool)
                reached = np.concatenate([[True], chain[:-1]]) & counted
                totals += np.stack([right, counted, chain & reached, reached])
                runs[first + r][j - 1] = int(chain.sum())  # replay_chain reads the run at x_j from row j - 1
    return scores(totals, sequences, runs)


def replay_chain(sequences, runs, k: int) -> tuple[float, list[float]]:
    """(tokens per verify step — bonus included, the prefill's token not —, the share of verify steps that accepted
    each of the k draft positions) that greedy chain drafting of k tokens would give on these sequences, replayed:
    the engine, having committed x_0..x_j (x_j the last verify's bonus, or the prefill's token), drafts from row
    j-1 and accepts min(runs[j-1], k) drafts plus the bonus. Unlike the per-position rates over all positions,
    this visits only the positions where verify steps start, as the engine does: after an accepted chain they land
    past the easy tokens it consumed, so the all-positions rates overstate the engine's."""
    tokens = verifies = 0
    accepted = np.zeros(k, np.int64)  # verify steps that accepted position i
    for (ids, loss_mask), run in zip((s[:2] for s in sequences), runs):
        n, j = len(ids), int(np.argmax(loss_mask > 0))  # x_j: the first response token, from the prefill
        if not loss_mask[j] or j == 0:  # no response, or no prompt to prefill
            continue
        while j < n - 1:
            took = int(min(run[j - 1], k))
            made = min(took + 1, n - 1 - j)
            accepted[: min(took, made)] += 1
            j += made
            tokens += made
            verifies += 1
    return tokens / max(verifies, 1), [round(float(a) / max(verifies, 1), 4) for a in accepted]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m train.heldout",
        description="Teacher-forced acceptance of an EAGLE-3 head or a DFlash block drafter on held-out shards "
        "(python -m train.data generate): per-step accuracy and the chain's mean accepted length, over every "
        "response position.",
    )
    p.add_argument("--draft", required=True, metavar="DIR",
                   help="the head's directory (any layout) or a DFlash drafter's (z-lab's layout) (required; no "
                   "default)")
    p.add_argument("--data", required=True, nargs="+", metavar="DIR",
                   help="shard directories of held-out sequences, e.g. data/smollm2-heldout/mt_bench (required; no "
                   "default)")
    p.add_argument("--target", default=None, metavar="DIR",
                   help="the head's target, a Hugging Face directory (default: the built-in SmolLM2-135M-Instruct)")
    p.add_argument("--quantize", choices=("int8", "fp8"), default=None,
                   help="score against the target with its decoder weights quantized at load, as generate's "
                   "--quantize runs it (default: none, the checkpoint's weights)")
    p.add_argument("--num-draft", type=int, default=5, metavar="K",
                   help="draft steps per chain: chain_1 .. chain_K are replayed (default: 5; a DFlash drafter's "
                   "at most its block size - 1)")
    return p


def main(argv=None) -> int:
    from jaxspec.cli.program import main_guard

    @main_guard
    def run(argv):
        args = build_parser().parse_args(argv)
        from jaxspec.checkpoints.dflash import dflash_config_from_hf, load_dflash
        from jaxspec.checkpoints.heads import load_head, read_head_config
        from jaxspec.checkpoints.hf import load_target
        from jaxspec.cli.loading import head_aux_layer_ids, is_dflash_draft, resolve_target
        from jaxspec.config import load_target_config
        from jaxspec.engine.generation import default_dtype
        from jaxspec.engine.generator import check_head_fits
        from train.data import check_heldout_quantization, read_shards, require_shards

        if args.num_draft < 1:
            raise JaxspecError(f"--num-draft must be at least 1, got {args.num_draft}")
        for d in args.data:
            require_shards(Path(d), "held-out shards")
        check_heldout_quantization(args.data, args.quantize)
        target_dir = resolve_target(args.target)
        # the target returns the layers this drafter reads (checked against both configs before any weights load)
        aux = head_aux_layer_ids(args.draft, target_dir)
        block = is_dflash_draft(args.draft)
        if block:
            size = dflash_config_from_hf(read_head_config(args.draft), load_target_config(target_dir)).block_size
            if args.num_draft > size - 1:
                raise JaxspecError(f"--num-draft {args.num_draft}: this DFlash drafter's blocks of {size} draft at "
                                   f"most {size - 1} tokens per step; pass --num-draft {size - 1} or less")
        target = load_target(target_dir, dtype=default_dtype(), aux_layer_ids=aux, quantize=args.quantize)
        target.numerics = None
        if block:
            drafter = load_dflash(Path(args.draft), target.config, dtype=target.dtype)
            score = functools.partial(block_heldout_acceptance, target, drafter)
        else:
            head = load_head(Path(args.draft), target.config, dtype=target.dtype)
            check_head_fits(target, head)
            score = functools.partial(heldout_acceptance, target, head)
        for d in args.data:
            result = score(read_shards(Path(d)), args.num_draft)
            print(json.dumps({"data": str(d), "draft": str(args.draft), "quantize": args.quantize, **result}))
        return 0

    return run(argv)


if __name__ == "__main__":
    from jaxspec.cli.program import run_program

    run_program(main)
