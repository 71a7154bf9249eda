"""A DFlash block drafter trained by `python -m train.launch` (`drafter: dflash`).

The same run as an EAGLE-3 head's, with the drafter's own objective: self-distilled shards, one sequence per row
with `dflash.num_anchors` blocks drawn in its responses (train/block_batches.py), the frozen target computing the
drafter's features online in each step, the weighted block cross-entropy (train/dflash.py), orbax checkpoints (a
killed run resumes exactly: the batch of step s is a pure function of the seed and s), metrics in
<out>/metrics.jsonl (and TensorBoard), every `eval_every` steps the engine's mean accepted length on `eval_prompts`
and the chain replayed teacher-forced on each `eval_data` set (train/heldout.py), and the drafter exported in
z-lab's layout (<out>/drafter-zlab: `jaxspec.generate --draft` loads it, as do z-lab's, vLLM's and SGLang's
loaders) with the acceptance it measured.

The drafter's embedding table and LM head are the target's (DFlash shares them), so only its own layers learn.
"""

from __future__ import annotations

import functools
import json
import math
import threading
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxspec.config import DFlashConfig, TargetConfig
from jaxspec.errors import JaxspecError
from jaxspec.models.dflash import DFlashDrafter
from train.config import DFlashSection, RunConfig
from train.dflash import block_loss
from train.heldout import block_heldout_acceptance
from train.precision import cast_floats, computing_in, resolve_compute_dtype
from train.run_io import (
    RunInputs,
    acceptance_of,
    acceptance_records,
    check_resumed_target,
    close_run,
    eval_on,
    eval_prompts,
    evaluations_before,
    heldout_key,
    open_metrics,
    read_sequences,
    stop_on_nonfinite,
)

MASTER_DTYPE = jnp.float32  # the drafter's weights and optimizer state (a step may compute in bfloat16: precision.py)


class BlockStep(NamedTuple):
    """One step's arrays on device (`train.block_batches.BlockBatch`)."""

    ids: jax.Array  # [B, S] int32
    loss_mask: jax.Array  # [B, S] int32
    anchors: jax.Array  # [B, A] int32
    anchor_valid: jax.Array  # [B, A] bool


def drafter_config(target: TargetConfig, d: DFlashSection) -> DFlashConfig:
    """The drafter the `dflash:` section asks for, shaped for the target where it leaves a key null."""
    from jaxspec.checkpoints.dflash import check_drafter_fits

    overrides = {"num_layers": d.num_layers, "block_size": d.block_size}
    for key in ("intermediate_size", "mask_token_id"):
        if getattr(d, key) is not None:
            overrides[key] = getattr(d, key)
    if d.target_layer_ids is not None:
        overrides["target_layer_ids"] = tuple(d.target_layer_ids)
    cfg = DFlashConfig.for_target(target, **overrides)
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise JaxspecError(f"dflash.mask_token_id {cfg.mask_token_id} is outside the target's vocabulary "
                           f"(0..{target.vocab_size - 1})")
    check_drafter_fits(cfg, target, built=False)  # the target is then loaded to return these layers' features
    return cfg


def dflash_step(target_graphdef, target_params, drafter_graphdef, params, opt_state, batch: BlockStep, *, tx,
                loss_decay: float, compute_dtype=None):
    """One optimizer step; returns (params, opt_state, loss, metrics). The target (plain numerics) computes the
    drafter's features of every position; the drafter's blocks at the anchors read them as context.

    compute_dtype: mixed precision (train/precision.py): the target is already a copy in that dtype, the drafter
    computes with its master params cast to it (drafter_graphdef: a drafter of that dtype, `computing_in`), and the
    gradient flows back through the cast to the float32 masters. None: everything in the masters' float32."""
    target = nnx.merge(target_graphdef, target_params)
    b, s = batch.ids.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    out = target(batch.ids, positions, target.init_cache(b, s), return_aux=True, empty_cache=True)
    features = jax.lax.stop_gradient(out.aux)  # [B, S, n_aux·H]; the logits are unused and compiled away

    def loss_fn(params):
        if compute_dtype is not None:
            params = cast_floats(params, compute_dtype)
        drafter = nnx.merge(drafter_graphdef, params)
        return block_loss(drafter, target, features, batch.ids, batch.loss_mask, batch.anchors, loss_decay,
                          batch.anchor_valid)

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, metrics


def evaluate_dflash(target, drafter: DFlashDrafter, tokenizer, target_dir, t) -> tuple[float, list[float]]:
    """(mean accepted length, acceptance per draft position) of the engine with this drafter's chains of
    `num_draft_steps` on the first `eval_num_prompts` of `eval_prompts`."""
    from jaxspec.engine.generation import Generator
    from jaxspec.engine.proposers.dflash import DFlashProposer

    encoded, stops = eval_prompts(tokenizer, target_dir, target, t)
    proposer, params = DFlashProposer.of(drafter, t.num_draft_steps)
    gen = Generator(target, proposer=proposer, proposer_params=params, batch_size=len(encoded))
    return acceptance_of(gen.generate(encoded, max_new_tokens=t.eval_max_new_tokens, stop_ids=stops))


def run_dflash(cfg: RunConfig, inputs: RunInputs, stop: threading.Event | None = None) -> dict:
    """train.launch's run for `drafter: dflash` (its inputs checked by `run_io.check_inputs`)."""
    from tqdm import tqdm

    from jaxspec.checkpoints.dflash import export_dflash
    from jaxspec.checkpoints.hf import load_target
    from jaxspec.checkpoints.verifier import verifier_name
    from jaxspec.config import load_target_config
    from jaxspec.engine.generation import default_dtype
    from train.block_batches import BlockBatches
    from train.checkpointing import RunCheckpoints
    from train.step import batch_sharding, make_mesh, make_optimizer, param_sharding

    t, out, target_dir = cfg.train, inputs.out, inputs.target_dir
    dcfg = drafter_config(load_target_config(target_dir), cfg.dflash)
    # the target in the dtype generation runs it in (its features, embedding and LM head), returning the drafter's
    # layers; plain numerics: the objective needs values, not the verifier's bits
    target = load_target(target_dir, dtype=default_dtype(), aux_layer_ids=dcfg.aux_layer_ids,
                         quantize=cfg.target.quantize)
    target.numerics = None
    batches = BlockBatches(read_sequences(inputs.data_dirs), t.seq_len, t.batch_size, cfg.dflash.num_anchors, t.seed,
                           cfg.dflash.group_by_length)
    if batches.cut_tokens or batches.dropped:
        say(f"{batches.cut_tokens} tokens past train.seq_len are cut; {batches.dropped} sequences without a response "
            "token to anchor a block are left out")
    drafter = DFlashDrafter(dcfg, dtype=MASTER_DTYPE, rngs=nnx.Rngs(t.seed))
    say(f"{len(batches.rows)} sequences; a DFlash drafter of {dcfg.num_layers} layers, blocks of {dcfg.block_size}, "
        f"reading target layers {list(dcfg.target_layer_ids)} (z-lab ids), mask token {dcfg.mask_token_id}")

    tx = make_optimizer(cfg.optim)
    dgd, params = nnx.split(drafter, nnx.Param)
    mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp)
    params = jax.device_put(params, param_sharding(mesh, params))
    state = {"params": params, "opt_state": jax.jit(tx.init)(params)}
    ckpt = RunCheckpoints(out / "checkpoints", keep=t.keep_checkpoints)
    start, meta = 0, {}
    restored = ckpt.restore_latest(state, say=say)
    if restored is not None:
        _, state, meta = restored
        start = meta["next_step"]
        if meta.get("data_order") != batches.settings:
            order = meta.get("data_order") or {}
            changed = ", ".join(sorted(k for k in {*order, *batches.settings}
                                       if order.get(k) != batches.settings.get(k)))
            raise JaxspecError(f"{out} was trained with other data or batch settings ({changed}): resuming would "
                               "not continue the same run; restore them or use a new out")
        check_resumed_target(out, meta, cfg.target.quantize)
        say(f"resumed from step {start}")
    # A run keeps the compute dtype it started with (runs saved before mixed precision computed in float32); auto
    # times the step's largest matmul, the target's LM head over every block slot of a batch.
    recorded = meta.get("compute_dtype", "float32") if start else None
    compute = recorded if t.compute_dtype == "auto" and recorded else resolve_compute_dtype(
        t.compute_dtype, t.batch_size * cfg.dflash.num_anchors * dcfg.block_size, dcfg.hidden_size,
        target.config.vocab_size,
    )
    mixed = compute != jnp.dtype(MASTER_DTYPE).name
    say(f"computing in {compute} ({f'master weights {jnp.dtype(MASTER_DTYPE).name}, ' if mixed else ''}"
        f"train.compute_dtype: {t.compute_dtype})")
    # `target` itself evaluates; the step's copy shares its weights when they are already in `compute`
    tgd, tparams = nnx.split(computing_in(target, compute) if mixed else target)
    tparams = jax.device_put(tparams, param_sharding(mesh, tparams))
    step_dgd = nnx.split(computing_in(drafter, compute), nnx.Param)[0] if mixed else dgd
    step_fn = jax.jit(functools.partial(dflash_step, tgd, drafter_graphdef=step_dgd, tx=tx,
                                        loss_decay=cfg.dflash.loss_decay, compute_dtype=compute if mixed else None),
                      donate_argnames=("params", "opt_state"))
    heldout = {d: read_sequences([Path(d).expanduser()]) for d in inputs.eval_dirs}  # scored at evaluations
    for eval_dir, found in heldout.items():
        if not found:
            raise JaxspecError(f"the held-out shards in {eval_dir!r} (train.eval_data) hold no sequences")
    metrics_file, board = open_metrics(out)
    params, opt_state = state["params"], state["opt_state"]
    last, interrupted = {}, False
    last_eval, last_heldout, _ = evaluations_before(out / "metrics.jsonl", start, t)
    for step in tqdm(range(start, t.steps), initial=start, total=t.steps, desc="train", unit="step"):
        host = batches(step)
        batch = jax.device_put(BlockStep(host.ids, host.loss_mask, host.anchors, host.anchor_valid),
                               batch_sharding(mesh))
        begin = time.perf_counter()
        params, opt_state, loss, metrics = step_fn(tparams, params=params, opt_state=opt_state, batch=batch)
        loss = float(loss)
        if not math.isfinite(loss):
            stop_on_nonfinite(loss, step, metrics_file, ckpt)
        record = {
            "step": step, "loss": loss, **{k: round(float(v), 5) for k, v in metrics.items()},
            "tokens_per_second": round(host.real_tokens / (time.perf_counter() - begin), 1),  # padding not counted
            "epoch": round(batches.epoch_of_step(step + 1), 4),
        }
        evaluating = t.eval_every and (step + 1) % t.eval_every == 0
        if evaluating:
            # scored in the target's dtype, as generation loads the exported drafter
            scored_drafter = computing_in(nnx.merge(dgd, params), target.dtype)
            for eval_dir, sequences in heldout.items():
                scored = block_heldout_acceptance(target, scored_drafter, sequences, t.num_draft_steps)
                record[heldout_key(eval_dir)] = scored
                last_heldout[eval_dir] = (step + 1, scored)
        if evaluating and t.eval_prompts:
            from jaxspec.prompts import load_tokenizer

            mean, rates = evaluate_dflash(target, nnx.merge(dgd, params), load_tokenizer(target_dir), target_dir, t)
            record.update(eval_on=eval_on(t), eval_mean_accepted_length=round(mean, 4),
                          eval_acceptance_per_position=rates)
            last_eval = (step + 1, record["eval_mean_accepted_length"], rates)
        if step % t.log_every == 0 or evaluating or step == t.steps - 1:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
            if board is not None:
                for name, value in record.items():
                    if isinstance(value, dict):  # a held-out score: the replayed chain's tokens per verify
                        k = t.num_draft_steps
                        board.add_scalar(f"train/{name}_chain_{k}", value[f"chain_{k}"], step)
                    elif name != "step" and isinstance(value, (int, float)):  # per-position lists stay in the JSONL
                        board.add_scalar(f"train/{name}", value, step)
                board.flush()
        interrupted = stop is not None and stop.is_set()
        if (step + 1) % t.checkpoint_every == 0 or step == t.steps - 1 or interrupted:
            ckpt.save(step + 1, {"params": params, "opt_state": opt_state},
                      {"next_step": step + 1, "data_order": batches.settings, "drafter": "dflash",
                       "target_quantize": cfg.target.quantize, "compute_dtype": compute})
        last = record
        if interrupted:
            say(f"saved step {step + 1}; the same command resumes from it")
            break
    close_run(metrics_file, board, ckpt)
    if interrupted:
        return {**last, "interrupted": True}
    drafter_dir = out / "drafter-zlab"
    export_dflash(nnx.merge(dgd, params), drafter_dir, target=target.config, dtype="bfloat16",
                  verifier=verifier_name(cfg.target.path, drafter_dir), quantization=cfg.target.quantize,
                  acceptance=acceptance_records(t, last_eval, last_heldout))
    say(f"exported the drafter to {drafter_dir}")
    return last


def say(message: str) -> None:
    import sys

    print(message, file=sys.stderr)
