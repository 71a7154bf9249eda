"""python -m train.launch --config configs/NAME.yaml [key.sub=value ...]: train an EAGLE-3 head or a DFlash drafter.

`drafter: dflash` trains a DFlash block drafter instead (train/dflash_run.py, the same data, checkpoints, logs and
evaluation); what follows is the EAGLE-3 head's run.

Reads self-distilled shards (train/data.py), packs them into fixed-length rows (train/packing.py), builds the draft
vocabulary from their response tokens, trains with the frozen target computing features online (or reading
them from `python -m train.data features`), checkpoints with orbax (a killed run resumes exactly: the batch of step
s is a pure function of the seed and s), logs metrics to <out>/metrics.jsonl (and TensorBoard when tensorboardX is
installed), measures real mean accepted length
with the speculative engine every eval_every steps, and exports the head in the speculators and SGLang layouts.
The config and its overrides are checked against the schema in train/config.py before anything runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from jaxspec.errors import JaxspecError
from train.config import HeadSection, RunConfig, TrainSection, load_config
from train.packing import PackedBatches
from train.run_io import (
    acceptance_of,
    acceptance_records,
    close_run,
    eval_on,
    evaluations_before,
    heldout_key,
    tree_keys,
    check_inputs,
    check_resumed_target,
    eval_prompts,
    open_metrics,
    read_sequences,
    stop_on_nonfinite,
)

if TYPE_CHECKING:
    from jaxspec.engine.tree import TreeConfig

MASTER_DTYPE = np.dtype("float32")  # the head's trained weights and optimizer state, whatever the step computes in


def build_head(target, hcfg: HeadSection, counts: np.ndarray, seed: int, prior: np.ndarray | None = None):
    import jax.numpy as jnp
    from flax import nnx

    from jaxspec.config import HeadConfig
    from jaxspec.models.eagle3 import Eagle3Head
    from train.vocab import build_vocab_map

    t = target.config
    if hcfg.init_from:
        return _warm_start(target, hcfg)
    vd = hcfg.draft_vocab_size or t.vocab_size
    d2t, _ = build_vocab_map(counts, vd, prior)
    head_cfg = HeadConfig.for_target(
        t, draft_vocab_size=vd, intermediate_size=hcfg.intermediate_size or t.intermediate_size,
        num_layers=hcfg.num_layers, fc_norm=hcfg.fc_norm, norm_output=hcfg.norm_output,
    )
    head = Eagle3Head(head_cfg, dtype=MASTER_DTYPE, rngs=nnx.Rngs(seed))
    head.d2t.set_value(jnp.asarray(d2t, jnp.int32))
    if hcfg.init_lm_head_from_target:
        rows = np.arange(vd) + d2t
        table = target.embed_tokens[...] if target.lm_head is None else target.lm_head.kernel[...].T
        head.lm_head.kernel.set_value(jnp.asarray(table[rows].T).astype(head.lm_head.kernel.dtype))
    return head


def head_shape(head) -> dict:
    """What a run's checkpoints must match in the head's config (`head:`), recorded with each checkpoint."""
    c = head.config
    return {"num_layers": c.num_layers, "draft_vocab_size": c.draft_vocab_size,
            "intermediate_size": c.intermediate_size, "fc_norm": c.fc_norm, "norm_output": c.norm_output}


def check_head_shape(out: Path, recorded: dict | None, wanted: dict) -> None:
    """A resumed run whose config now asks for another head shape is refused in one line before restoring
    (orbax would fail on the tree's structure or shapes, naming neither key)."""
    changed = {k: v for k, v in (recorded or {}).items() if k in wanted and wanted[k] != v}
    if changed:
        settings = ", ".join(f"head.{k}={v}" for k, v in sorted(changed.items()))
        raise JaxspecError(f"{out} was trained with {settings}; the config asks for another head: restore "
                           f"{'them' if len(changed) > 1 else 'it'} to resume, or use a new out")


def _warm_start(target, hcfg: HeadSection):
    """The head of `head.init_from`, in MASTER_DTYPE, whose shape must be the one the config asks for."""
    from jaxspec.checkpoints.heads import load_head
    from jaxspec.engine.generator import check_head_fits

    head = load_head(Path(hcfg.init_from).expanduser(), target.config, dtype=MASTER_DTYPE)
    if head.config.mask_token_id is not None:
        raise JaxspecError(f"head.init_from {hcfg.init_from!r} is a P-EAGLE head (parallel drafting), which "
                           "train.launch cannot train yet (its objective is EAGLE-3's step-by-step one); start from "
                           "an EAGLE-3 head")
    check_head_fits(target, head)  # it reads the layers the target returns (the target's default aux layers)
    defaults = {f.name: f.default for f in dataclasses.fields(HeadSection)}
    for key, value in (("draft_vocab_size", head.config.draft_vocab_size),
                       ("intermediate_size", head.config.intermediate_size), ("num_layers", head.config.num_layers),
                       ("fc_norm", head.config.fc_norm), ("norm_output", head.config.norm_output)):
        wanted = getattr(hcfg, key)
        if wanted and wanted not in (defaults[key], value):  # a key left at its default takes the head's value
            raise JaxspecError(
                f"head.init_from {hcfg.init_from!r} has {key} {value}, the config asks for {wanted}: set "
                f"head.{key}={value} (or leave it out) to continue that head"
            )
    return head


def evaluate(target, head, tokenizer, target_dir, t: TrainSection, tree: TreeConfig | None = None
             ) -> tuple[float, list[float]]:
    """(mean accepted length — tokens per verify, bonus included —, the share of verify steps that accepted each
    draft position, or each tree depth) on the first prompts of the eval file, with a chain of `num_draft_steps`
    or `tree` (a TreeConfig): the held-out curve, and the profile an exported head records for automatic
    speculation (`jaxspec.engine.auto.config.profile_from_record`, `trees_from_record`)."""
    from jaxspec.engine.generator import SpeculativeGenerator

    encoded, stops = eval_prompts(tokenizer, target_dir, target, t)
    gen = SpeculativeGenerator(target, head, num_draft=t.num_draft_steps, tree=tree, batch_size=len(encoded))
    return acceptance_of(gen.generate(encoded, max_new_tokens=t.eval_max_new_tokens, stop_ids=stops))


def run(cfg: RunConfig, stop: threading.Event | None = None) -> dict:
    import jax
    from flax import nnx
    from tqdm import tqdm

    from jaxspec.checkpoints.heads import export_head
    from jaxspec.checkpoints.hf import load_target
    from jaxspec.checkpoints.verifier import verifier_name
    from jaxspec.engine.generation import default_dtype
    from train.checkpointing import RunCheckpoints
    from train.data import check_features_quantization, read_shards
    from train.precision import computing_in, resolve_compute_dtype
    from train.step import (
        Batch,
        batch_sharding,
        make_mesh,
        make_optimizer,
        param_sharding,
        split_head,
        train_step,
    )
    from train.vocab import coverage, training_counts

    t = cfg.train
    inputs = check_inputs(cfg)  # before the target loads and anything is written
    if cfg.drafter == "dflash":
        from train.dflash_run import run_dflash

        return run_dflash(cfg, inputs, stop)
    out, data_dirs, eval_dirs, target_dir = inputs.out, inputs.data_dirs, inputs.eval_dirs, inputs.target_dir
    # The target in the dtype generation runs it in (bfloat16 on GPU/TPU, float32 on CPU): the evaluation measures
    # what inference would, and a step computing in that dtype uses it as it is, with no second copy (an 8B target
    # held in float32 beside its bfloat16 copy was 48 GB)
    target = load_target(target_dir, dtype=default_dtype(), quantize=cfg.target.quantize)
    target.numerics = None  # the teacher's logits and features only need their values: plain XLA numerics, faster
    from train.heldout import heldout_acceptance

    heldout = {d: read_shards(Path(d).expanduser()) for d in eval_dirs}
    for eval_dir, found in heldout.items():
        if not found:
            raise JaxspecError(f"the held-out shards in {eval_dir!r} (train.eval_data) hold no sequences")
    if t.features == "offline":
        check_features_quantization(data_dirs, cfg.target.quantize)
    sequences = read_sequences(data_dirs, with_features=t.features == "offline")
    # The draft vocabulary comes from all but every 20th sequence; its coverage of those held out says how often
    # a target token cannot be drafted at all (a cap on acceptance). Prompt tokens too rank the tokens responses
    # never used (a small dataset leaves many such ties).
    counts, held_out, every_token = training_counts(sequences, target.config.vocab_size)
    vocab = target.config.vocab_size
    head = build_head(target, cfg.head, counts, t.seed, prior=every_token)
    for spec, tree in t.trees.items():  # checked before training, not at the first evaluation
        if tree.top_k > head.config.draft_vocab_size:
            raise JaxspecError(f"train.eval_trees {spec}: TOPK exceeds the head's draft vocabulary "
                               f"({head.config.draft_vocab_size})")
    draft_mask = np.zeros(vocab, bool)
    draft_mask[np.asarray(head.to_target_ids(np.arange(head.config.draft_vocab_size)))] = True
    print(
        f"{len(sequences)} sequences, {int(counts.sum() + held_out.sum())} response tokens; draft vocabulary "
        f"{head.config.draft_vocab_size} covers {coverage(counts, draft_mask):.4f} of training tokens and "
        f"{coverage(held_out, draft_mask):.4f} of held-out ones",
        file=sys.stderr,
    )

    optim = cfg.optim  # its total_steps is train.steps
    tx = make_optimizer(optim)
    hgd, params, frozen = split_head(head, optim.freeze_lm_head)  # params: the master weights the optimizer updates
    mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp)
    params = jax.device_put(params, param_sharding(mesh, params))
    frozen = jax.device_put(frozen, param_sharding(mesh, frozen))
    opt_state = jax.jit(tx.init)(params)
    state = {"params": params, "opt_state": opt_state}

    batches = PackedBatches(sequences, t.seq_len, t.batch_size, t.num_draft_steps, t.seed, t.trained_positions or None)
    if batches.cut_tokens:
        print(f"{batches.cut_tokens} tokens past train.seq_len (or train.trained_positions) are cut", file=sys.stderr)
    ckpt = RunCheckpoints(out / "checkpoints", keep=t.keep_checkpoints)
    check_head_shape(out, (ckpt.latest_meta() or {}).get("head_shape"), head_shape(head))
    start, meta = 0, {}
    restored = ckpt.restore_latest(state, say=lambda msg: print(msg, file=sys.stderr))
    if restored is not None:
        _, state, meta = restored
        start = meta["next_step"]
        order = meta.get("data_order")
        if order is not None and order != batches.settings:
            changed = ", ".join(sorted(k for k in order if order[k] != batches.settings.get(k)))
            raise JaxspecError(
                f"{out} was trained with other data or batch settings ({changed}): resuming would not continue "
                "the same run; restore them or use a new out"
            )
        check_resumed_target(out, meta, cfg.target.quantize)
        print(f"resumed from step {start}", file=sys.stderr)
    # A run keeps the compute dtype it started with, so that a resumed run continues the same arithmetic.
    recorded = meta.get("compute_dtype") if start else None
    compute = recorded if t.compute_dtype == "auto" and recorded else resolve_compute_dtype(
        t.compute_dtype, t.batch_size * (t.trained_positions or t.seq_len), head.config.hidden_size,
        head.config.draft_vocab_size,
    )
    mixed = compute != head.dtype  # the head's master weights are MASTER_DTYPE (build_head)
    print(f"computing in {compute} ({f'master weights {head.dtype}, ' if mixed else ''}"
          f"train.compute_dtype: {t.compute_dtype})", file=sys.stderr)
    # `target` itself evaluates; the step's copy shares its weights when they are already in `compute`
    step_target = computing_in(target, compute)
    tgd, tparams = nnx.split(step_target)
    tparams = jax.device_put(tparams, param_sharding(mesh, tparams))
    step_hgd = split_head(computing_in(head, compute), optim.freeze_lm_head)[0] if mixed else hgd
    step_fn = jax.jit(
        functools.partial(train_step, tgd, head_graphdef=step_hgd, tx=tx, num_steps=t.num_draft_steps,
                          compute_dtype=compute if mixed else None, teacher_temperature=t.teacher_temperature),
        donate_argnames=("params", "opt_state"),
    )
    metrics_file, board = open_metrics(out)
    params, opt_state = state["params"], state["opt_state"]
    last, interrupted = {}, False
    last_eval, last_heldout, last_trees = evaluations_before(out / "metrics.jsonl", start, t)
    for step in tqdm(range(start, t.steps), initial=start, total=t.steps, desc="train", unit="step"):
        packed = batches(step)
        batch = jax.device_put(
            Batch(packed.ids, packed.loss_mask, packed.aux, packed.hidden, packed.positions, packed.segments,
                  packed.trained),
            batch_sharding(mesh),
        )
        begin = time.perf_counter()
        params, opt_state, loss, metrics = step_fn(
            tparams, params=params, frozen=frozen, opt_state=opt_state, batch=batch
        )
        loss = float(loss)
        if not math.isfinite(loss):
            stop_on_nonfinite(loss, step, metrics_file, ckpt)
        record = {
            "step": step,
            "loss": loss,
            **{k: round(float(v), 5) for k, v in metrics.items()},
            "tokens_per_second": round(packed.real_tokens / (time.perf_counter() - begin), 1),  # padding not counted
            "epoch": round(batches.epoch_of_step(step + 1), 4),
        }
        evaluating = t.eval_every and (step + 1) % t.eval_every == 0
        if evaluating:
            # evaluated as generation runs it: in the target's dtype (the master weights themselves when they are)
            merged = computing_in(nnx.merge(hgd, params, frozen), target.dtype)
            for eval_dir in eval_dirs:
                scored = heldout_acceptance(target, merged, heldout[eval_dir], t.num_draft_steps)
                record[heldout_key(eval_dir)] = scored
                last_heldout[eval_dir] = (step + 1, scored)
        if evaluating and t.eval_prompts:
            from jaxspec.prompts import load_tokenizer

            tokenizer = load_tokenizer(target_dir)
            mean, rates = evaluate(target, merged, tokenizer, target_dir, t)
            record["eval_on"] = eval_on(t)
            record["eval_mean_accepted_length"] = round(mean, 4)
            record["eval_acceptance_per_position"] = rates
            last_eval = (step + 1, record["eval_mean_accepted_length"], rates)
            for spec, tree in t.trees.items():
                mean, rates = evaluate(target, merged, tokenizer, target_dir, t, tree)
                mean_key, rates_key = tree_keys(spec)
                record[mean_key] = round(mean, 4)
                record[rates_key] = rates
                last_trees[spec] = (step + 1, round(mean, 4), rates)
        if step % t.log_every == 0 or evaluating or step == t.steps - 1:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
            if board is not None:
                for name, value in record.items():
                    if isinstance(value, dict):  # a held-out score: the replayed chain's tokens per verify
                        k = t.num_draft_steps
                        board.add_scalar(f"train/{name}_chain_{k}", value[f"chain_{k}"], step)
                    elif name != "step" and not isinstance(value, list):  # per-position lists stay in the JSONL
                        board.add_scalar(f"train/{name}", value, step)
                board.flush()
        interrupted = stop is not None and stop.is_set()
        if (step + 1) % t.checkpoint_every == 0 or step == t.steps - 1 or interrupted:
            ckpt.save(step + 1, {"params": params, "opt_state": opt_state},
                      {"next_step": step + 1, "data_order": batches.settings, "compute_dtype": compute,
                       "head_shape": head_shape(head), "target_quantize": cfg.target.quantize})
        last = record
        if interrupted:
            print(f"saved step {step + 1}; the same command resumes from it", file=sys.stderr)
            break
    close_run(metrics_file, board, ckpt)
    if interrupted:
        return {**last, "interrupted": True}
    head = nnx.merge(hgd, params, frozen)
    for layout in ("speculators", "sglang"):
        head_dir = out / f"head-{layout}"
        export_head(head, head_dir, layout=layout, target=target.config, dtype="bfloat16",
                    verifier=verifier_name(cfg.target.path, head_dir), quantization=cfg.target.quantize,
                    acceptance=acceptance_records(t, last_eval, last_heldout, last_trees))
    return last


def build_parser() -> argparse.ArgumentParser:
    from jaxspec.cli.args import OneLineParser

    parser = OneLineParser(
        prog="python -m train.launch",
        description=__doc__.split("\n")[0],
        epilog="The config's keys, their types and defaults: train/config.py (RunConfig). Every key is checked "
        "before the run starts: unknown, missing or mistyped ones are errors.",
    )
    parser.add_argument(
        "--config",
        required=True,
        metavar="FILE.yaml",
        help="the run's YAML config: data, out, target, head, train, optim, mesh (required; no default)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key.sub=value",
        default=[],
        help="settings that replace the config's, applied in order; the value is read as YAML, e.g. "
        "train.steps=1000 target=null (default: none)",
    )
    return parser


def main(argv=None) -> int:
    from jaxspec.cli.program import main_guard

    parser = build_parser()

    @main_guard
    def _main(argv):
        args = parser.parse_args(argv)
        last = run(load_config(args.config, args.overrides), stop=STOP)
        return 130 if last.get("interrupted") else 0

    return _main(argv)


STOP = threading.Event()  # set by the first Ctrl-C when run as a program: save a checkpoint, then exit 130

if __name__ == "__main__":
    from jaxspec.cli.program import run_program

    run_program(main, stop=STOP)
