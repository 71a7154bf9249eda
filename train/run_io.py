"""What every training run of `train.launch` shares, whatever it trains (an EAGLE-3 head, a DFlash drafter): the
inputs checked before the target loads, the training sequences, the metrics log, the stop on a non-finite loss and
the engine's evaluation prompts."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from jaxspec.errors import JaxspecError
from train.config import MeshSection, RunConfig, TrainSection


@dataclasses.dataclass(frozen=True)
class RunInputs:
    out: Path  # the run directory, created
    data_dirs: list[Path]  # training shard directories (one mix)
    eval_dirs: list[str]  # held-out shard directories scored at evaluations (train.eval_data)
    target_dir: Path


def check_inputs(cfg: RunConfig) -> RunInputs:
    """Join a multi-host job (`distributed`), then check what the config names before the target loads and anything
    is written: the mesh fits the devices, out is writable, the shards, the head to start from and the evaluation
    prompts exist. Creates out."""
    import jax

    from jaxspec.cli.loading import resolve_target
    from jaxspec.cli.outputs import check_output_dir
    from jaxspec.files import make_dir
    from train.data import check_heldout_quantization, require_shards

    t = cfg.train
    if cfg.distributed:  # multi-host (a TPU slice, several GPU hosts): one process per host
        try:
            jax.distributed.initialize()
        except ValueError as e:  # no cluster environment found
            raise JaxspecError(f"distributed: true cannot join a job here ({e}); run it on a TPU slice or under "
                               "SLURM or Open MPI, or set distributed: false") from None
    check_mesh_devices(cfg.mesh, jax.device_count(), jax.default_backend())
    out = check_output_dir(Path(cfg.out).expanduser(), holds_own=lambda d: any((d / n).exists() for n in RUN_FILES),
                           what="training run", overwrite=False,
                           fix="use a new or empty out, or the out of an earlier run to resume it", flag="out")
    data_dirs = [Path(d).expanduser() for d in ((cfg.data,) if isinstance(cfg.data, str) else cfg.data)]
    for data_dir in data_dirs:
        require_shards(data_dir, "training shards")
    if cfg.head.init_from:
        from jaxspec.checkpoints.heads import read_head_config

        read_head_config(Path(cfg.head.init_from).expanduser())  # a missing head fails now, not after loading
    eval_dirs = list(t.eval_data or ()) if t.eval_every else []  # scored only at evaluations
    for eval_dir in eval_dirs:
        require_shards(Path(eval_dir).expanduser(), "held-out shards (train.eval_data)")
    check_heldout_quantization([Path(d).expanduser() for d in eval_dirs], cfg.target.quantize)
    if t.eval_every and t.eval_prompts:
        from jaxspec.prompts import prompt_set_path, read_prompts_file

        # a missing file fails now, not after eval_every steps
        read_prompts_file(prompt_set_path(str(Path(t.eval_prompts).expanduser())))
    make_dir(out, "out")
    claim_out(out, cfg.drafter)
    return RunInputs(out, data_dirs, eval_dirs, resolve_target(cfg.target.path))


DRAFTER_MARK = "drafter.txt"  # in a run directory: what its checkpoints hold, when not an EAGLE-3 head
RUN_FILES = ("checkpoints", "metrics.jsonl", "tensorboard", DRAFTER_MARK)  # what a run writes first into its out


def claim_out(out: Path, drafter: str) -> None:
    """Refuse a run directory whose checkpoints hold another kind of drafter (restoring them into this run's state
    would fail and set them aside as unreadable); mark it as this drafter's. A directory with checkpoints and no
    mark is an EAGLE-3 head's (runs before block drafters wrote none). A directory of other files than a run's was
    refused earlier (`check_inputs`)."""
    mark = out / DRAFTER_MARK
    ckpts = out / "checkpoints"
    found = mark.read_text().strip() if mark.is_file() else None
    if found is None and ckpts.is_dir() and any(p.name.isdigit() for p in ckpts.iterdir()):
        found = "eagle3"
    if found is not None and found != drafter:
        raise JaxspecError(f"out {str(out)!r} holds the checkpoints of a {found} run, and this config trains "
                           f"drafter: {drafter}; use another out")
    if drafter != "eagle3":
        mark.write_text(drafter + "\n")


def check_mesh_devices(mesh: MeshSection, available: int, backend: str) -> None:
    """The `mesh:` section must fit the devices there are (checked before the target loads: jax.make_mesh's own
    error came after it)."""
    wanted = mesh.data * mesh.fsdp
    if wanted > available:
        hint = f"; on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={wanted} simulates them" \
            if backend == "cpu" else ""
        raise JaxspecError(f"mesh data={mesh.data} x fsdp={mesh.fsdp} needs {wanted} devices, but {available} are "
                           f"visible ({backend}); lower mesh.data or mesh.fsdp{hint}")


def read_sequences(data_dirs: list[Path], with_features: bool = False) -> list[tuple]:
    """The training sequences of every data directory, as one mix (the batching shuffles them together)."""
    from train.data import read_shards

    sequences = []
    for data_dir in data_dirs:
        found = read_shards(data_dir, with_features=with_features)
        if not found:
            raise JaxspecError(f"the training shards in {str(data_dir)!r} hold no sequences")
        sequences += found
    return sequences


def open_metrics(out: Path):
    """(<out>/metrics.jsonl opened to append, a TensorBoard writer on <out>/tensorboard or None without
    tensorboardX). A line cut by a kill stays alone: the next record is not glued onto it."""
    path = out / "metrics.jsonl"
    cut = _ends_mid_line(path)
    metrics_file = path.open("a")
    if cut:
        metrics_file.write("\n")
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        return metrics_file, None
    return metrics_file, SummaryWriter(str(out / "tensorboard"))


def close_run(metrics_file, board, ckpt) -> None:
    """Close what a training loop held open: its metrics log, TensorBoard writer (or None) and checkpoints."""
    metrics_file.close()
    if board is not None:
        board.close()
    ckpt.close()


def _ends_mid_line(path: Path) -> bool:
    if not path.is_file() or not path.stat().st_size:
        return False
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def stop_on_nonfinite(loss: float, step: int, metrics_file, ckpt) -> None:
    """A step whose loss is NaN or infinite ends the run: its update is not saved and nothing is exported (a NaN
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


def eval_prompts(tokenizer, target_dir, target, t: TrainSection) -> tuple[list[list[int]], list[int]]:
    """(the first `eval_num_prompts` prompts of `eval_prompts`, encoded with the chat template; the stop ids) that
    an engine evaluation generates from."""
    from jaxspec.prompts import encode_prompt, prompt_set_path, read_prompts_file, stop_token_ids

    prompts = read_prompts_file(prompt_set_path(str(Path(t.eval_prompts).expanduser())))[: t.eval_num_prompts]
    encoded = [encode_prompt(tokenizer, text, raw=False) for _, text in prompts]
    return encoded, stop_token_ids(tokenizer, target_dir, target.config.eos_token_ids)


def acceptance_of(completions) -> tuple[float, list[float]]:
    """(mean accepted length — tokens per verify, bonus included —, the share of verify steps that accepted each
    draft position) of an evaluation's completions."""
    from jaxspec.engine.generation import tokens_per_verify

    calls = sum(c.stats["verify_calls"] for c in completions)
    accepted = np.sum([c.stats["accepted_per_position"] for c in completions], axis=0)
    return tokens_per_verify(completions) or 1.0, [round(float(a) / max(calls, 1), 4) for a in accepted]


def acceptance_records(t: TrainSection, last_eval: tuple[int, float, list[float]] | None,
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


def evaluations_before(metrics: Path, start: int, t: TrainSection):
    """(last_eval, last_heldout, last_trees) as the loop keeps them, rebuilt from the run's own log for the steps
    before `start`: a resumed run that makes no new evaluation still exports the profile its earlier one measured
    (auto's prior), instead of none. Kept only what the current config would have measured: engine evaluations
    on the same eval_prompts, count and length (`eval_on`), the held-out sets and trees it still names. Records
    of steps at or past `start` were logged by an attempt killed before its checkpoint (those steps run again),
    and a step-0 record begins another run in the same out (its checkpoints deleted): neither is kept."""
    last_eval, last_heldout, last_trees = None, {}, {}
    if not start or not metrics.is_file():
        return last_eval, last_heldout, last_trees
    engine_on = eval_on(t) if t.eval_every and t.eval_prompts else None
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
            scored = record.get(heldout_key(eval_dir))
            if scored is not None:
                last_heldout[eval_dir] = (done, scored)
        if engine_on is None or record.get("eval_on") != engine_on:
            continue
        if "eval_mean_accepted_length" in record:
            last_eval = (done, record["eval_mean_accepted_length"], record["eval_acceptance_per_position"])
        for spec in t.trees:
            mean_key, rates_key = tree_keys(spec)
            if mean_key in record:
                last_trees[spec] = (done, record[mean_key], record[rates_key])
    return last_eval, last_heldout, last_trees


def heldout_key(eval_dir: str) -> str:
    """The metrics record's key of a held-out set's scores (written at evaluations, read back on resume)."""
    return f"heldout_{Path(eval_dir).name}"


def tree_keys(spec: str) -> tuple[str, str]:
    """The metrics record's keys of a tree's engine evaluation (mean accepted length, acceptance per position):
    written at evaluations, read back on resume."""
    return f"eval_tree_{spec}_mean_accepted_length", f"eval_tree_{spec}_acceptance_per_position"


def eval_on(t: TrainSection) -> list:
    """What an engine evaluation ran on, logged beside its figures: a resumed run keeps only figures of its own."""
    return [t.eval_prompts, t.eval_num_prompts, t.eval_max_new_tokens]


def check_resumed_target(out: Path, meta: dict, quantize: str | None) -> None:
    """Refuse to resume a run whose checkpoints learned another verifier: the target quantized otherwise
    (`target.quantize`; a checkpoint without the key was trained against the weights as stored)."""
    from train.data import weights_phrase

    trained = meta.get("target_quantize")
    if trained != quantize:
        raise JaxspecError(
            f"{out} was trained against the target {weights_phrase(trained)}, and the config asks for it "
            f"{weights_phrase(quantize)}: restore target.quantize or use a new out"
        )

