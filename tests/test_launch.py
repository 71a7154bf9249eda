"""The training launcher: checkpoints, exact resume after SIGKILL, metrics, export.

Each `train.launch` subprocess costs 30-60 s on 2 cores, so CI runs one per promise (a killed run resumes exactly, a
stop signal saves a checkpoint, a non-finite loss stops without saving, evaluation); the rest are marked slow."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from hf_tiny import make_training_setup

from train.data import read_shards

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("launch")
    make_training_setup(base)
    return base


def config(base: Path, name: str, steps: int, **head) -> Path:
    cfg = {
        "target": str(base / "target"), "data": str(base / "data"), "out": str(base / name),
        "head": {"draft_vocab_size": 48, "intermediate_size": 96, **head},
        "train": {"num_draft_steps": 3, "batch_size": 4, "seq_len": 24, "steps": steps, "seed": 0,
                  "checkpoint_every": 2, "keep_checkpoints": 2, "log_every": 1, "eval_every": 0,
                  "compute_dtype": "float32"},  # auto would time this machine's matmuls: other runs, other dtypes
        "optim": {"learning_rate": 0.003, "warmup_steps": 2},
    }
    path = base / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def launch(cfg: Path, *overrides, wait=True):
    cmd = [sys.executable, "-m", "train.launch", "--config", str(cfg), *overrides]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if wait:
        _, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err
    return proc


def losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[r["step"]] = r["loss"]
    return out


def test_data_shards_round_trip(setup):
    seqs = read_shards(setup / "data")
    assert len(seqs) == 24 and all(m[:5].sum() == 0 and m[5:].all() for _, m in seqs)


def test_killed_run_resumes_exactly(setup):
    launch(config(setup, "straight", 10))
    straight = losses(setup / "straight")
    assert sorted(straight) == list(range(10))
    exported = json.loads((setup / "straight" / "head-speculators" / "config.json").read_text())
    assert exported["draft_vocab_size"] == 48 and (setup / "straight" / "head-sglang" / "model.safetensors").is_file()

    proc = launch(config(setup, "killed", 10), wait=False)
    ckpts = setup / "killed" / "checkpoints"
    deadline = time.time() + 600
    while time.time() < deadline and not (ckpts.is_dir() and any(p.name.isdigit() and int(p.name) >= 4 for p in ckpts.iterdir())):
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    launch(config(setup, "killed", 10))  # resumes from the last complete checkpoint
    resumed = losses(setup / "killed")
    assert sorted(resumed) == list(range(10))
    for step in range(10):
        assert resumed[step] == pytest.approx(straight[step], rel=1e-6, abs=1e-6)
    kept = sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())
    assert kept == [8, 10]  # keep the last 2
    # resuming with another packing would not continue the same data order: refused, nothing written
    proc = launch(config(setup, "killed", 12), "train.seq_len=32", wait=False)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 2 and "other data or batch settings (seq_len, trained_positions)" in err
    assert sorted(losses(setup / "killed")) == list(range(10))


@pytest.mark.slow
def test_a_resumed_run_keeps_its_compute_dtype(setup):
    """auto is resolved once per run: the dtype is in the checkpoint, and a resume under auto continues in it."""
    cfg = config(setup, "mixed", 4)
    first = launch(cfg, "train.steps=2", "train.compute_dtype=bfloat16", wait=False)
    _, err = first.communicate(timeout=900)
    assert first.returncode == 0, err
    assert "computing in bfloat16 (master weights float32" in err
    second = launch(cfg, "train.compute_dtype=auto", wait=False)
    _, err = second.communicate(timeout=900)
    assert second.returncode == 0, err
    assert "resumed from step 2" in err and "computing in bfloat16" in err
    assert sorted(losses(setup / "mixed")) == [0, 1, 2, 3]


@pytest.mark.slow
def test_a_list_of_datasets_trains_as_one_mix(setup):
    """data: [A, B] reads every shard of both (here the same 24 sequences twice: 48) and trains on the mix."""
    import shutil

    second = setup / "data-second"
    if not second.exists():
        shutil.copytree(setup / "data", second)
    proc = launch(config(setup, "mix", 2), f"data=[{setup / 'data'}, {second}]", wait=False)
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err
    assert "48 sequences" in err and sorted(losses(setup / "mix")) == [0, 1]


def test_bad_override(setup, capsys):
    from train.launch import main

    with pytest.raises(SystemExit) as exc:
        main(["--config", str(config(setup, "x", 1)), "train.steps"])
    assert exc.value.code == 2 and "is not key=value" in capsys.readouterr().err


@pytest.mark.slow  # ~36 s: two short runs; CI: the data checks below (quantized targets: tests/test_quantize.py)
def test_a_head_trains_against_the_quantized_target(setup):
    """`target.quantize: int8`: the teacher is the target with int8 weights (its first loss is not the float
    target's, for the same head and batch), the exported head records that verifier, and a resume against the float
    target is refused."""
    from jaxspec.errors import JaxspecError
    from train.config import load_config
    from train.launch import run

    run(load_config(config(setup, "float-teacher", 1)))
    run(load_config(config(setup, "int8-teacher", 2), ["target.quantize=int8"]))
    float_loss, int8_loss = losses(setup / "float-teacher")[0], losses(setup / "int8-teacher")[0]
    assert int8_loss != float_loss and int8_loss == pytest.approx(float_loss, rel=0.05)
    record = json.loads((setup / "int8-teacher" / "head-speculators" / "config.json").read_text())["jaxspec"]
    assert record["verifier"]["quantization"] == "int8"
    with pytest.raises(JaxspecError, match="trained against the target quantized to int8, and the config asks for "
                                           "it as stored"):
        run(load_config(config(setup, "int8-teacher", 3)))


def test_data_of_another_quantization_is_refused(setup, tmp_path):
    """Cached features of the target as stored do not train a head for its int8 form, and held-out data written by
    the target as stored does not score the int8 one."""
    from jaxspec.errors import JaxspecError
    from train.data import FEATURES_META, check_features_quantization, check_heldout_quantization

    (tmp_path / FEATURES_META).write_text(json.dumps({"quantize": None}))
    with pytest.raises(JaxspecError, match="come from the target as stored, and target.quantize asks for it "
                                           "quantized to int8"):
        check_features_quantization([tmp_path], "int8")
    check_features_quantization([tmp_path], None)
    # held-out replay scores the data's tokens as the target's own greedy output: int8 needs int8-written data
    with pytest.raises(JaxspecError, match="written by the target as stored, and this run scores the target "
                                           "quantized to int8"):
        check_heldout_quantization([setup / "data"], "int8")
    check_heldout_quantization([setup / "data"], None)


@pytest.mark.slow
def test_offline_features_train_like_online(setup):
    from train.data import main as data_main

    # rows of 48 tokens: most hold two or three sequences, none fits a 29-token one twice
    assert data_main(["features", "--target", str(setup / "target"), "--data", str(setup / "data"),
                      "--seq-len", "48", "--compute-dtype", "float32"]) == 0
    seqs = read_shards(setup / "data", with_features=True)
    assert seqs[0][2].shape == (len(seqs[0][0]), 3 * 64) and seqs[0][3].shape == (len(seqs[0][0]), 64)
    # packed features equal each sequence's own forward (up to bfloat16 rounding of float32 values)
    import jax.numpy as jnp

    from jaxspec.checkpoints.hf import load_target
    from train.step import target_features

    target = load_target(setup / "target")
    target.numerics = None
    for ids, _, aux, hidden in seqs[:6]:
        want_aux, want_hidden = target_features(target, jnp.asarray(ids)[None])
        np.testing.assert_allclose(np.asarray(aux, np.float32), np.asarray(want_aux[0]), rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(np.asarray(hidden, np.float32), np.asarray(want_hidden[0]), rtol=2e-2, atol=2e-2)
    # rows of 16: sequences longer than a row run alone (in rows of 32); the same features
    import shutil

    short = setup / "data-short-rows"
    short.mkdir()
    shutil.copy(setup / "data" / "shard-00000.npz", short)
    assert data_main(["features", "--target", str(setup / "target"), "--data", str(short), "--seq-len", "16",
                      "--compute-dtype", "float32"]) == 0
    for (_, _, aux, hidden), (_, _, aux2, hidden2) in zip(seqs, read_shards(short, with_features=True)):
        np.testing.assert_allclose(np.asarray(aux2, np.float32), np.asarray(aux, np.float32), rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(np.asarray(hidden2, np.float32), np.asarray(hidden, np.float32), rtol=2e-2,
                                   atol=2e-2)
    # computed in bfloat16: each sequence's own forward by a bfloat16 copy of the target (train.precision)
    from train.precision import computing_in

    wide = setup / "data-bfloat16"
    wide.mkdir()
    shutil.copy(setup / "data" / "shard-00000.npz", wide)
    assert data_main(["features", "--target", str(setup / "target"), "--data", str(wide), "--seq-len", "48",
                      "--compute-dtype", "bfloat16"]) == 0
    narrow = computing_in(target, jnp.bfloat16)
    for ids, _, aux, hidden in read_shards(wide, with_features=True)[:6]:
        want_aux, want_hidden = target_features(narrow, jnp.asarray(ids)[None])
        np.testing.assert_allclose(np.asarray(aux, np.float32), np.asarray(want_aux[0], np.float32), rtol=2e-2,
                                   atol=2e-2)
        np.testing.assert_allclose(np.asarray(hidden, np.float32), np.asarray(want_hidden[0], np.float32),
                                   rtol=2e-2, atol=2e-2)
    launch(config(setup, "online", 3))
    launch(config(setup, "offline", 3), "train.features=offline")
    online, offline = losses(setup / "online"), losses(setup / "offline")
    for step in range(3):  # bfloat16 features vs float32 ones
        assert offline[step] == pytest.approx(online[step], rel=2e-2)


@pytest.mark.slow
def test_tensorboard_scalars_follow_the_jsonl_log(setup):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    launch(config(setup, "board", 2))
    events = EventAccumulator(str(setup / "board" / "tensorboard"))
    events.Reload()
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert loss == [(s, pytest.approx(v)) for s, v in sorted(losses(setup / "board").items())]


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_the_run_resumes(setup):
    """The first Ctrl-C stops after the current step, saves it, exits 130; the same command resumes from there."""
    proc = launch(config(setup, "interrupted", 400), "train.checkpoint_every=1000", wait=False)
    metrics = setup / "interrupted" / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "saved step" in err
    ckpts = setup / "interrupted" / "checkpoints"
    saved = max(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())
    assert 2 <= saved < 400  # not a scheduled checkpoint (every 1000): the interrupt's own
    assert sorted(losses(setup / "interrupted")) == list(range(saved))
    launch(config(setup, "interrupted", saved + 2), "train.checkpoint_every=1000")
    assert sorted(losses(setup / "interrupted")) == list(range(saved + 2))  # resumed at `saved`, nothing redone


@pytest.mark.parametrize("signals", [pytest.param(("SIGTERM",), marks=pytest.mark.slow), ("SIGINT", "SIGINT")],
                         ids=["sigterm", "sigint-twice-at-once"])
def test_a_stop_signal_saves_a_checkpoint_even_when_it_arrives_twice(setup, signals):
    """A SIGTERM (a preempted VM, a scheduler) saves as the first Ctrl-C does; a signal sent to the whole process
    group arrives twice at once, and that is one request, not 'Ctrl-C again: quit, unsaved'."""
    name = "stopped-" + "-".join(signals).lower()
    proc = launch(config(setup, name, 400), "train.checkpoint_every=1000", wait=False)
    metrics = setup / name / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        time.sleep(0.2)
    for sig in signals:
        proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "saved step" in err
    assert any(p.name.isdigit() for p in (setup / name / "checkpoints").iterdir())


@pytest.mark.slow
def test_init_from_starts_from_an_exported_head(setup, tmp_path):
    """`head.init_from`: a run continues an exported head (its weights and draft vocabulary), e.g. in a new sitting."""
    import jax

    from jaxspec.checkpoints.heads import export_head
    from jaxspec.checkpoints.hf import load_target
    from jaxspec.errors import JaxspecError
    from train.config import HeadSection
    from train.launch import build_head

    target = load_target(setup / "target")
    counts = np.arange(target.config.vocab_size, dtype=np.int64)
    trained = build_head(target, HeadSection(draft_vocab_size=48, intermediate_size=96), counts, seed=3)
    export_head(trained, tmp_path / "head", layout="speculators", target=target.config, dtype="float32")
    warm = build_head(target, HeadSection(48, 96, init_from=str(tmp_path / "head")), counts[::-1].copy(), seed=0)
    want, got = jax.tree.leaves(trained), jax.tree.leaves(warm)
    assert len(want) == len(got) and all(np.array_equal(a, b) for a, b in zip(want, got))  # vocabulary included
    with pytest.raises(JaxspecError, match="has draft_vocab_size 48, the config asks for 32"):
        build_head(target, HeadSection(32, 96, init_from=str(tmp_path / "head")), counts, seed=0)
    # the launcher: a run from the exported head, and a missing one refused before anything loads
    launch(config(setup, "warm", 2), f"head.init_from={tmp_path / 'head'}")
    assert sorted(losses(setup / "warm")) == [0, 1]
    proc = launch(config(setup, "warm-missing", 2), f"head.init_from={tmp_path / 'nothing'}", wait=False)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "error:" in err and "nothing" in err


def test_evaluation_gives_the_profile_automatic_speculation_reads(setup, tmp_path):
    """The launcher's held-out evaluation: tokens per verify and per-position acceptance, recorded in the exported
    head's config in the form `--num-speculative-tokens auto` takes as its prior."""
    from hf_tiny import ByteTokenizer

    from jaxspec.checkpoints.hf import load_target
    from jaxspec.checkpoints.verifier import check_acceptance
    from jaxspec.engine.auto.config import profile_from_record
    from train.config import HeadSection, TrainSection
    from train.launch import build_head, evaluate
    from train.run_io import acceptance_records as _acceptance

    class ChatBytes(ByteTokenizer):
        chat_template = "the text itself"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return messages[0]["content"]

    target = load_target(setup / "target")
    head = build_head(target, HeadSection(48, 96), np.arange(target.config.vocab_size), seed=0)
    prompts = tmp_path / "held_out.jsonl"
    prompts.write_text('{"id": "a", "prompt": "abcabc"}\n{"id": "b", "prompt": "hello there"}\n')
    t = TrainSection(num_draft_steps=3, batch_size=1, seq_len=8, steps=1, eval_every=1, eval_prompts=str(prompts),
                     eval_num_prompts=2, eval_max_new_tokens=8, eval_trees=("6,3,2",))
    mean, rates = evaluate(target, head, ChatBytes(), setup / "target", t)
    assert len(rates) == 3 and all(0 <= b <= a <= 1 for a, b in zip([1.0, *rates], rates))
    assert mean == pytest.approx(1 + sum(rates), abs=0.35)  # stopped rows make the two differ slightly
    record = _acceptance(t, (1, mean, rates))
    check_acceptance(record)
    assert profile_from_record(record).rates == pytest.approx(rates)
    # a tree on the same prompts (train.eval_trees): recorded beside the chain, a candidate of automatic speculation
    from jaxspec.engine.auto.config import trees_from_record
    from jaxspec.engine.tree import TreeConfig

    (tree,) = t.trees.values()
    assert tree == TreeConfig(6, 3, 2)
    tree_mean, tree_rates = evaluate(target, head, ChatBytes(), setup / "target", t, tree)
    assert len(tree_rates) == 3 and tree_mean >= 1.0
    record = _acceptance(t, (1, mean, rates), None, {"6,3,2": (1, tree_mean, tree_rates)})
    check_acceptance(record)
    assert [m["method"] for m in record] == ["chain K=3", "tree 6,3,2"]
    assert trees_from_record(record) == {tree: pytest.approx(max(1.0, tree_mean))}
    assert profile_from_record(record).rates == pytest.approx(rates)  # the chain's prior is the chain's alone


def _one_row_hits(target, head, sequences, num_steps):
    """(right, counted) [K, positions] written out for every sequence packed in one row: step k of row t is right
    where the head's argmax, as a target id, is the token at t+2+k, counted where that token is a response token
    of t's own sequence."""
    import jax.numpy as jnp

    from train.packing import PackedBatches
    from train.step import target_features
    from train.ttt import ttt_logits

    b = PackedBatches([s[:2] for s in sequences], 1024, 1, num_steps, seed=0)(0)
    features, _ = target_features(target, b.ids, b.positions, b.segments)
    next_ids = np.concatenate([b.ids[:, 1:], np.zeros_like(b.ids[:, :1])], axis=1)
    logits = ttt_logits(head, target.embed_tokens[...], features, next_ids, num_steps, b.positions, b.segments,
                        b.trained)
    to_target = np.asarray(head.to_target_ids(jnp.arange(head.config.draft_vocab_size)))
    ids, mask, seg, t_len = b.ids[0], b.loss_mask[0], b.segments[0], b.ids.shape[1]
    right, counted = np.zeros((2, num_steps, len(b.trained[0])), bool)
    for k in range(num_steps):
        drafted = to_target[np.asarray(logits[k][0]).argmax(-1)]
        for c, t in enumerate(b.trained[0]):
            at = t + 2 + k
            counted[k, c] = at < t_len and mask[at] > 0 and seg[at] == seg[t] > 0
            right[k, c] = counted[k, c] and drafted[c] == ids[at]
    return right, counted


@pytest.mark.slow
def test_heldout_acceptance_sums_exactly_over_batches(setup, monkeypatch):
    """train.heldout: a step is right where the head's greedy draft is the token the data hold; the rates over many
    small batches (the last one wrapping into the next epoch, its repeats dropped) equal one batch holding every
    sequence and a direct count."""
    from jaxspec.checkpoints.hf import load_target
    from train import heldout
    from train.config import HeadSection
    from train.launch import build_head
    from train.packing import PackedBatches

    target = load_target(setup / "target")
    head = build_head(target, HeadSection(48, 96), np.arange(target.config.vocab_size), seed=2)
    sequences = read_shards(setup / "data")
    whole = heldout.heldout_acceptance(target, head, sequences, 3)
    monkeypatch.setattr(heldout, "ROW_LEN", 32)  # 24 sequences of 12-29 tokens: one or two per row
    rows = len(PackedBatches([s[:2] for s in sequences], 32, 1, 3, seed=0).epoch_rows(0))
    monkeypatch.setattr(heldout, "ROWS", 1)  # a batch per row
    split = heldout.heldout_acceptance(target, head, sequences, 3)
    monkeypatch.setattr(heldout, "ROWS", rows - 1)  # the second batch: one row, then rows - 2 repeats dropped
    wrapped = heldout.heldout_acceptance(target, head, sequences, 3)
    assert rows > 3
    assert whole["positions"] == sum(len(s[0]) - 5 for s in sequences)  # every response token (prompts: 5)
    for other in (split, wrapped):
        assert other["positions"] == whole["positions"]
        for key in ("accuracy", "conditional_acceptance", "tau", "chain_1", "chain_3"):
            assert other[key] == pytest.approx(whole[key], abs=1e-4)
    right, counted = _one_row_hits(target, head, sequences, 3)
    assert whole["accuracy"] == pytest.approx(list((right & counted).sum(1) / counted.sum(1)), abs=1e-4)


def test_heldout_replay_counts_runs_of_draftable_tokens(setup):
    """With a zero LM head every draft logit ties, so a step is right exactly where the data's token lies in the
    draft vocabulary (a tie counts as right; a token outside it never does): the rates and the replayed chains
    follow from the data alone."""
    import jax.numpy as jnp

    from jaxspec.checkpoints.hf import load_target
    from train import heldout
    from train.config import HeadSection
    from train.launch import build_head

    target = load_target(setup / "target")
    head = build_head(target, HeadSection(48, 96), np.arange(target.config.vocab_size), seed=2)
    head.lm_head.kernel.set_value(jnp.zeros_like(head.lm_head.kernel[...]))
    draftable = np.zeros(target.config.vocab_size, bool)
    draftable[np.asarray(head.to_target_ids(jnp.arange(48)))] = True
    sequences = read_shards(setup / "data")
    got = heldout.heldout_acceptance(target, head, sequences, 3)
    runs, hits, total = [], np.zeros(3), 0
    for ids, mask in sequences:
        n = len(ids)
        run = np.zeros(n, np.int64)
        for t in range(n):
            while run[t] < 3 and t + 2 + run[t] < n and mask[t + 2 + run[t]] and draftable[ids[t + 2 + run[t]]]:
                run[t] += 1
        runs.append(run)
        for k in range(3):
            at = np.arange(n) + 2 + k
            ok = (at < n) & (mask[np.minimum(at, n - 1)] > 0)
            hits[k] += (ok & draftable[ids[np.minimum(at, n - 1)]]).sum()
        total += int(mask.sum())
    assert 0.2 < got["accuracy"][0] < 0.8  # the data's tokens: about half of them draftable
    assert got["accuracy"] == pytest.approx(list(hits / total), abs=1e-4)
    for k in (1, 2, 3):
        assert got[f"chain_{k}"] == pytest.approx(heldout.replay_chain(sequences, runs, k)[0], abs=1e-4)
    assert got["chain_3"] > got["chain_1"] > 1.0


@pytest.mark.slow
def test_a_run_scores_held_out_shards_at_each_evaluation(setup):
    """train.eval_data: held-out shard directories scored teacher-forced every eval_every steps, in the log."""
    launch(config(setup, "heldout", 4), "train.eval_every=2", f"train.eval_data=[{setup / 'data'}]")
    records = [json.loads(line) for line in (setup / "heldout" / "metrics.jsonl").read_text().splitlines()]
    scored = {r["step"]: r["heldout_data"] for r in records if "heldout_data" in r}
    assert sorted(scored) == [1, 3]
    for s in scored.values():
        assert s["positions"] > 0 and len(s["accuracy"]) == 3 and s["tau"] >= 1.0
    proc = launch(config(setup, "heldout-missing", 2), "train.eval_every=2", "train.eval_data=[nowhere]", wait=False)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "nowhere" in err
    # the exported head records the last replay as its acceptance profile, the prior automatic speculation reads
    from jaxspec.checkpoints.verifier import check_acceptance
    from jaxspec.engine.auto.config import profile_from_record

    exported = json.loads((setup / "heldout" / "head-speculators" / "config.json").read_text())["jaxspec"]
    (record,) = check_acceptance(exported["acceptance"])
    assert record["prompts"] == "data" and record["num_prompts"] == 24 and record["method"] == "chain K=3"
    assert record["mean_accepted_length"] == scored[3]["chain_3"]
    assert profile_from_record([record]).rates == pytest.approx(scored[3]["chain_3_acceptance_per_position"])
    # the command scores an exported head the same way
    cli = [sys.executable, "-m", "train.heldout", "--draft", str(setup / "heldout" / "head-speculators"),
           "--target", str(setup / "target"), "--num-draft", "3", "--data"]
    done = subprocess.run([*cli, str(setup / "data")], check=False, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["positions"] == scored[3]["positions"] and min(out[f"chain_{k}"] for k in (1, 2, 3)) >= 1.0
    done = subprocess.run([*cli, "nowhere"], check=False, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 2 and done.stderr.startswith("error:") and "nowhere" in done.stderr


@pytest.mark.slow
def test_a_resumed_run_exports_the_profile_of_its_earlier_evaluation(setup):
    """A run stopped after its last evaluation resumes without a new one: its head still records that evaluation
    (read back from the run's log), not no profile at all."""
    data = f"train.eval_data=[{setup / 'data'}]"
    launch(config(setup, "resumed-eval", 4), "train.eval_every=3", data)  # evaluates after step 3
    first = json.loads((setup / "resumed-eval" / "head-speculators" / "config.json").read_text())["jaxspec"]
    launch(config(setup, "resumed-eval", 5), "train.eval_every=3", data)  # step 5 alone: no evaluation
    records = [json.loads(line) for line in (setup / "resumed-eval" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "heldout_data" in r] == [2] and max(r["step"] for r in records) == 4
    again = json.loads((setup / "resumed-eval" / "head-speculators" / "config.json").read_text())["jaxspec"]
    (record,) = again["acceptance"]
    assert again["acceptance"] == first["acceptance"]
    assert record["measured_by"] == "train.heldout replay (teacher-forced) after step 3"


def test_a_resume_keeps_only_evaluations_its_config_would_have_made(tmp_path):
    """What a resumed run rebuilds from its log: the last evaluations before the checkpoint it resumed from, of
    this run (after its step 0), on what its config evaluates; not a killed attempt's later records, a cut line,
    another run's, or engine figures on other prompts or with engine evaluation off."""
    from train.config import TrainSection
    from train.run_io import eval_on as _eval_on, evaluations_before as _evaluations_before

    t = TrainSection(num_draft_steps=2, batch_size=1, seq_len=8, steps=20, eval_every=4, eval_prompts="mt_bench",
                     eval_data=("EVAL/mt_bench",), eval_trees=("6,3,2",))

    def evaluation(step, mean, on=None):
        return {"step": step, "loss": 1.0, "heldout_mt_bench": {"chain_2": mean}, "eval_on": on or _eval_on(t),
                "eval_mean_accepted_length": mean, "eval_acceptance_per_position": [mean - 1, 0.0],
                "eval_tree_6,3,2_mean_accepted_length": mean + 1, "eval_tree_6,3,2_acceptance_per_position": [0.5]}

    lines = [evaluation(3, 9.0), {"step": 0, "loss": 2.0}, {"step": 2, "loss": 1.5}, evaluation(3, 1.25),
             evaluation(7, 1.5, on=["gsm8k", 8, 64]), evaluation(11, 1.75)]
    log = tmp_path / "metrics.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in lines) + '\n{"step": 12, "lo')
    last_eval, heldout, trees = _evaluations_before(log, 11, t)  # resumed at 11: step 11's record was not saved
    assert last_eval == (4, 1.25, [0.25, 0.0]) and trees == {"6,3,2": (4, 2.25, [0.5])}  # not gsm8k's, at 8
    assert heldout == {"EVAL/mt_bench": (8, {"chain_2": 1.5})}  # held-out sets are the same whatever eval_prompts
    off = TrainSection(**{**t.__dict__, "eval_prompts": None})
    assert _evaluations_before(log, 12, off) == (None, {"EVAL/mt_bench": (12, {"chain_2": 1.75})}, {})
    assert _evaluations_before(log, 0, t) == (None, {}, {})  # a fresh run


def test_replayed_chain_follows_the_engine_from_verify_to_verify():
    """replay_chain by hand: a prompt of 2 and 8 response tokens; the engine holds x_2 from the prefill and drafts
    from row j-1 after committing x_j. runs (accepted drafts of a chain anchored at each row) chosen so that the
    path is 2 -> 5 (2 drafts + bonus) -> 6 (0 + bonus) -> 9 (K=2 caps 3 at 2, + bonus): 7 tokens in 3 verifies."""
    from train.heldout import replay_chain

    ids = np.arange(10)
    mask = np.array([0, 0] + [1] * 8)
    runs = np.array([0, 2, 9, 9, 0, 3, 9, 9, 9, 9])  # read at rows 1, 4, 5
    tokens, rates = replay_chain([(ids, mask)], [runs], 2)
    assert tokens == pytest.approx(7 / 3) and rates == pytest.approx([2 / 3, 2 / 3], abs=1e-4)  # rounded
    tokens, rates = replay_chain([(ids, mask)], [runs], 1)  # 2 -> 4 -> 6 -> 8 -> 9 (the last cut by the end)
    assert tokens == pytest.approx(7 / 4)


@pytest.mark.slow  # ~30 s; in CI a killed run resumes exactly and a stop signal saves (above)
def test_a_non_finite_loss_stops_the_run_without_saving_or_exporting(setup):
    """A learning rate that blows the head up (1e30: its updates make the weights overflow) ends the run with a
    one-line error at the first non-finite loss, exit 2, no head exported, and no checkpoint left that holds the
    parameters that gave it (a NaN learning rate once trained to NaN losses, exited 0 and exported a NaN head)."""
    proc = launch(config(setup, "diverged", 6), "optim.learning_rate=1e30", "optim.warmup_steps=0", wait=False)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 2, err
    assert "step 2: the loss is nan, so training stopped without saving or exporting (the checkpoint of step 2 held " \
        "these parameters and was removed; no checkpoint is left: a resume starts over)" in err, err
    ckpts = setup / "diverged" / "checkpoints"
    assert not [p for p in ckpts.iterdir() if p.name.isdigit()]
    assert err.strip().splitlines()[-1].startswith("error: step ")
    records = [json.loads(line) for line in (setup / "diverged" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["stopped"] == "non-finite loss" and not (setup / "diverged" / "head-speculators").exists()
