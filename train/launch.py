"""python -m train.launch --config configs/NAME.yaml [key.sub=value ...]: train an EAGLE-3 head with TTT.

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
import functools
import json
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from jaxspec.errors import JaxspecError
from train.config import HeadSection, MeshSection, RunConfig, TrainSection, load_config
from train.packing import PackedBatches

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
        t, draft_vocab_size=vd, intermediate_size=hcfg.intermediate_size or t.intermediate_size
    )
    head = Eagle3Head(head_cfg, dtype=MASTER_DTYPE, rngs=nnx.Rngs(seed))
    head.d2t.set_value(jnp.asarray(d2t, jnp.int32))
    if hcfg.init_lm_head_from_target:
        rows = np.arange(vd) + d2t
        table = target.embed_tokens[...] if target.lm_head is None else target.lm_head.kernel[...].T
        head.lm_head.kernel.set_value(jnp.asarray(table[rows].T).astype(head.lm_head.kernel.dtype))
    return head


def _warm_start(target, hcfg: HeadSection):
    """The head of `head.init_from`, in MASTER_DTYPE, whose shape must be the one the config asks for."""
    from jaxspec.checkpoints.heads import load_head
    from jaxspec.engine.generator import check_head_fits

    head = load_head(Path(hcfg.init_from).expanduser(), target.config, dtype=MASTER_DTYPE)
    check_head_fits(target, head)  # it reads the layers the target returns (the target's default aux layers)
    for key, value in (("draft_vocab_size", head.config.draft_vocab_size),
                       ("intermediate_size", head.config.intermediate_size)):
        wanted = getattr(hcfg, key)
        if wanted and wanted != value:
            raise JaxspecError(
                f"head.init_from {hcfg.init_from!r} has {key} {value}, the config asks for {wanted}: set "
                f"head.{key}={value} (or null) to continue that head"
            )
    return head


def evaluate(target, head, tokenizer, target_dir, t: TrainSection, tree: TreeConfig | None = None
             ) -> tuple[float, list[float]]:
    """(mean accepted length — tokens per verify, bonus included —, the share of verify steps that accepted each
    draft position, or each tree depth) on the first prompts of the eval file, with a chain of `num_draft_steps`
    or `tree` (a TreeConfig): the held-out curve, and the profile an exported head records for automatic
    speculation (`jaxspec.engine.auto.config.profile_from_record`, `trees_from_record`)."""
    from jaxspec.engine.generation import tokens_per_verify
    from jaxspec.prompts import encode_prompt, prompt_set_path, read_prompts_file, stop_token_ids
    from jaxspec.engine.generator import SpeculativeGenerator

    prompts = read_prompts_file(prompt_set_path(str(Path(t.eval_prompts).expanduser())))[: t.eval_num_prompts]
    encoded = [encode_prompt(tokenizer, text, raw=False) for _, text in prompts]
    stops = stop_token_ids(tokenizer, target_dir, target.config.eos_token_ids)
    gen = SpeculativeGenerator(target, head, num_draft=t.num_draft_steps, tree=tree, batch_size=len(encoded))
    out = gen.generate(encoded, max_new_tokens=t.eval_max_new_tokens, stop_ids=stops)
    calls = sum(c.stats["verify_calls"] for c in out)
    accepted = np.sum([c.stats["accepted_per_position"] for c in out], axis=0)
    return tokens_per_verify(out) or 1.0, [round(float(a) / max(calls, 1), 4) for a in accepted]


def _acceptance(t: TrainSection, last_eval: tuple[int, float, list[float]] | None,
                last_heldout: dict[str, tuple[int, dict]] | None = None,
                last_trees: dict[str, tuple[int, float, list[float]]] | None = None) -> list[dict] | None:
    """The exported head's acceptance profile: the run's last evaluations (`eval_every`), if it made any — the
    engine's on `eval_prompts` (the chain, and each of `eval_trees`), and the chain replayed on each `eval_data`
    set (train/heldout.py)."""
    records = []
    engine = [(f"chain K={t.num_draft_steps}", t.num_draft_steps, last_eval)] if last_eval is not None else []
    engine += [(f"tree {spec}", t.trees[spec].depth, e) for spec, e in (last_trees or {}).items()]
    for method, depth, (step, mean, rates) in engine:
        records.append({
            "prompts": Path(t.eval_prompts).stem, "num_prompts": t.eval_num_prompts,
            "method": method, "num_speculative_tokens": depth,
            "max_new_tokens": t.eval_max_new_tokens, "temperature": 0.0,
            "mean_accepted_length": max(1.0, mean), "acceptance_per_position": rates,
            "measured_by": f"train.launch evaluation after step {step}",
        })
    for eval_dir, (step, scored) in (last_heldout or {}).items():
        k = t.num_draft_steps
        records.append({
            "prompts": Path(eval_dir).name, "num_prompts": scored["sequences"], "method": f"chain K={k}",
            "num_speculative_tokens": k, "temperature": 0.0,
            "mean_accepted_length": max(1.0, scored[f"chain_{k}"]),
            "acceptance_per_position": scored[f"chain_{k}_acceptance_per_position"],
            "measured_by": f"train.heldout replay (teacher-forced) after step {step}",
        })
    return records or None


def _evaluations_before(metrics: Path, start: int, t: TrainSection):
    """(last_eval, last_heldout, last_trees) as the loop keeps them, rebuilt from the run's own log for the steps
    before `start`: a resumed run that makes no new evaluation still exports the profile its earlier one measured
    (auto's prior), instead of none. Kept only what the current config would have measured: engine evaluations
    on the same eval_prompts, count and length (`eval_on`), the held-out sets and trees it still names. Records
    of steps at or past `start` were logged by an attempt killed before its checkpoint (those steps run again),
    and a step-0 record begins another run in the same out (its checkpoints deleted): neither is kept."""
    last_eval, last_heldout, last_trees = None, {}, {}
    if not start or not metrics.is_file():
        return last_eval, last_heldout, last_trees
    engine_on = _eval_on(t) if t.eval_every and t.eval_prompts else None
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill mid-write
            continue
        if record.get("step") == 0:  # every run logs its step 0: what came before was another run
            last_eval, last_heldout, last_trees = None, {}, {}
        done = record.get("step", start) + 1
        if done > start:
            continue
        for eval_dir in t.eval_data or ():
            scored = record.get(_heldout_key(eval_dir))
            if scored is not None:
                last_heldout[eval_dir] = (done, scored)
        if engine_on is None or record.get("eval_on") != engine_on:
            continue
        if "eval_mean_accepted_length" in record:
            last_eval = (done, record["eval_mean_accepted_length"], record["eval_acceptance_per_position"])
        for spec in t.trees:
            mean_key, rates_key = _tree_keys(spec)
            if mean_key in record:
                last_trees[spec] = (done, record[mean_key], record[rates_key])
    return last_eval, last_heldout, last_trees


def _heldout_key(eval_dir: str) -> str:
    """The metrics record's key of a held-out set's scores (written at evaluations, read back on resume)."""
    return f"heldout_{Path(eval_dir).name}"


def _tree_keys(spec: str) -> tuple[str, str]:
    """The metrics record's keys of a tree's engine evaluation (mean accepted length, acceptance per position):
    written at evaluations, read back on resume."""
    return f"eval_tree_{spec}_mean_accepted_length", f"eval_tree_{spec}_acceptance_per_position"


def _ends_mid_line(path: Path) -> bool:
    if not path.is_file() or not path.stat().st_size:
        return False
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def _eval_on(t: TrainSection) -> list:
    """What an engine evaluation ran on, logged beside its figures: a resumed run keeps only figures of its own."""
    return [t.eval_prompts, t.eval_num_prompts, t.eval_max_new_tokens]


def _tensorboard(out: Path):
    """A TensorBoard writer on <out>/tensorboard when tensorboardX is installed (the JSONL log is always written)."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(out / "tensorboard"))


def run(cfg: RunConfig, stop: threading.Event | None = None) -> dict:
    import jax
    from flax import nnx
    from tqdm import tqdm

    from jaxspec.checkpoints.heads import export_head
    from jaxspec.checkpoints.hf import load_target
    from jaxspec.checkpoints.verifier import verifier_name
    from jaxspec.cli.loading import resolve_target
    from jaxspec.engine.generation import default_dtype
    from jaxspec.files import check_writable_dir, make_dir
    from train.checkpointing import RunCheckpoints
    from train.data import read_shards, require_shards
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
    if cfg.distributed:  # multi-host (a TPU slice, several GPU hosts): one process per host
        try:
            jax.distributed.initialize()
        except ValueError as e:  # no cluster environment found
            raise JaxspecError(f"distributed: true cannot join a job here ({e}); run it on a TPU slice or under "
                               "SLURM or Open MPI, or set distributed: false") from None
    # Inputs named by the config are checked before the target loads and anything is written.
    check_mesh_devices(cfg.mesh, jax.device_count(), jax.default_backend())
    out = check_writable_dir(Path(cfg.out).expanduser(), "out")
    data_dirs = [Path(d).expanduser() for d in ((cfg.data,) if isinstance(cfg.data, str) else cfg.data)]
    for data_dir in data_dirs:
        require_shards(data_dir, "training shards")
    if cfg.head.init_from:
        from jaxspec.checkpoints.heads import read_head_config

        read_head_config(Path(cfg.head.init_from).expanduser())  # a missing head fails now, not after loading
    eval_dirs = list(t.eval_data or ()) if t.eval_every else []  # scored only at evaluations
    for eval_dir in eval_dirs:
        require_shards(Path(eval_dir).expanduser(), "held-out shards (train.eval_data)")
    if t.eval_every and t.eval_prompts:
        from jaxspec.prompts import prompt_set_path, read_prompts_file

        # a missing file fails now, not after eval_every steps
        read_prompts_file(prompt_set_path(str(Path(t.eval_prompts).expanduser())))
    make_dir(out, "out")
    target_dir = resolve_target(cfg.target)
    # The target in the dtype generation runs it in (bfloat16 on GPU/TPU, float32 on CPU): the evaluation measures
    # what inference would, and a step computing in that dtype uses it as it is, with no second copy (an 8B target
    # held in float32 beside its bfloat16 copy was 48 GB)
    target = load_target(target_dir, dtype=default_dtype())
    target.numerics = None  # the teacher's logits and features only need their values: plain XLA numerics, faster
    from train.heldout import heldout_acceptance

    heldout = {d: read_shards(Path(d).expanduser()) for d in eval_dirs}
    for eval_dir, found in heldout.items():
        if not found:
            raise JaxspecError(f"the held-out shards in {eval_dir!r} (train.eval_data) hold no sequences")
    sequences = []
    for data_dir in data_dirs:  # several datasets are one mix: the packing shuffles them together
        found = read_shards(data_dir, with_features=t.features == "offline")
        if not found:
            raise JaxspecError(f"the training shards in {str(data_dir)!r} hold no sequences")
        sequences += found
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
    metrics_file = (out / "metrics.jsonl").open("a")
    if _ends_mid_line(out / "metrics.jsonl"):
        metrics_file.write("\n")  # a line cut by a kill stays alone: the next record is not glued onto it
    board = _tensorboard(out)
    params, opt_state = state["params"], state["opt_state"]
    last, interrupted = {}, False
    last_eval, last_heldout, last_trees = _evaluations_before(out / "metrics.jsonl", start, t)
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
            _stop_on_nonfinite(loss, step, metrics_file, ckpt)
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
                record[_heldout_key(eval_dir)] = scored
                last_heldout[eval_dir] = (step + 1, scored)
        if evaluating and t.eval_prompts:
            from jaxspec.prompts import load_tokenizer

            tokenizer = load_tokenizer(target_dir)
            mean, rates = evaluate(target, merged, tokenizer, target_dir, t)
            record["eval_on"] = _eval_on(t)
            record["eval_mean_accepted_length"] = round(mean, 4)
            record["eval_acceptance_per_position"] = rates
            last_eval = (step + 1, record["eval_mean_accepted_length"], rates)
            for spec, tree in t.trees.items():
                mean, rates = evaluate(target, merged, tokenizer, target_dir, t, tree)
                mean_key, rates_key = _tree_keys(spec)
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
                      {"next_step": step + 1, "data_order": batches.settings, "compute_dtype": compute})
        last = record
        if interrupted:
            print(f"saved step {step + 1}; the same command resumes from it", file=sys.stderr)
            break
    metrics_file.close()
    if board is not None:
        board.close()
    ckpt.close()
    if interrupted:
        return {**last, "interrupted": True}
    head = nnx.merge(hgd, params, frozen)
    for layout in ("speculators", "sglang"):
        head_dir = out / f"head-{layout}"
        export_head(head, head_dir, layout=layout, target=target.config, dtype="bfloat16",
                    verifier=verifier_name(cfg.target, head_dir),
                    acceptance=_acceptance(t, last_eval, last_heldout, last_trees))
    return last


def check_mesh_devices(mesh: MeshSection, available: int, backend: str) -> None:
    """The `mesh:` section must fit the devices there are (checked before the target loads: jax.make_mesh's own
    error came after it)."""
    wanted = mesh.data * mesh.fsdp
    if wanted > available:
        hint = f"; on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={wanted} simulates them" \
            if backend == "cpu" else ""
        raise JaxspecError(f"mesh data={mesh.data} x fsdp={mesh.fsdp} needs {wanted} devices, but {available} are "
                           f"visible ({backend}); lower mesh.data or mesh.fsdp{hint}")


def _stop_on_nonfinite(loss: float, step: int, metrics_file, ckpt) -> None:
    """A step whose loss is NaN or infinite ends the run: its update is not saved and no head is exported (a NaN
    learning rate once trained to NaN losses, exited 0 and exported a NaN head). A step's loss is computed from the
    parameters before its update, so a checkpoint saved at this step holds the parameters that gave it: that one is
    removed, and a resume starts from the last checkpoint whose parameters gave a finite loss. The log gets the
    step's loss; the error says where a resume starts."""
    metrics_file.write(json.dumps({"step": step, "loss": str(loss), "stopped": "non-finite loss"}) + "\n")
    metrics_file.close()
    removed = ckpt.latest_step() == step
    if removed:
        ckpt.delete(step)
    kept = ckpt.latest_step()
    ckpt.close()
    where = f"the checkpoint of step {step} held these parameters and was removed; " if removed else ""
    where += f"a resume starts from step {kept}" if kept is not None else "no checkpoint is left: a resume starts over"
    raise JaxspecError(f"step {step}: the loss is {loss}, so training stopped without saving or exporting ({where}); "
                       "lower optim.learning_rate or optim.grad_clip, or check the data")


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
