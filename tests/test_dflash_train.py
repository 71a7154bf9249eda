"""Training a DFlash block drafter (`train.launch` with `drafter: dflash`): the objective's many blocks per row are
what inference drafts one block at a time; batches are a pure function of (seed, step); a run checkpoints,
resumes exactly, evaluates with the engine and exports a drafter `jaxspec.generate --draft` loads."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx
from hf_tiny import ByteTokenizer, make_training_setup

from jaxspec.errors import JaxspecError
from train.block_batches import BlockBatches, anchor_positions


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("dflash_train")
    make_training_setup(base)
    (base / "prompts.jsonl").write_text('{"id": "a", "prompt": "abcabc"}\n{"id": "b", "prompt": "hello there"}\n')
    return base


def test_the_objective_drafts_each_block_as_inference_does(setup):
    """block_logits runs every anchor's block in one forward (context mask: positions before the anchor; block
    mask: its own block). Each block's logits equal the drafter run on that block alone, its cache holding the
    context up to the anchor: what the proposer does at inference."""
    from jaxspec.checkpoints.hf import load_target
    from jaxspec.config import DFlashConfig
    from jaxspec.models.dflash import DFlashDrafter
    from train.dflash import block_inputs, block_logits

    cfg0 = DFlashConfig.for_target(load_target(setup / "target").config, num_layers=2, block_size=4)
    target = load_target(setup / "target", aux_layer_ids=cfg0.aux_layer_ids)
    target.numerics = None
    drafter = DFlashDrafter(cfg0, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(1)
    n, s = 2, 20
    tokens = jnp.asarray(rng.integers(0, 97, (n, s)), jnp.int32)
    anchors = jnp.asarray([[0, 5, 17], [3, 9, 19]], jnp.int32)  # blocks running past the end included
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (n, s))
    features = target(tokens, positions, target.init_cache(n, s), return_aux=True).aux
    logits, labels = block_logits(drafter, target, features, tokens, anchors)
    block, block_pos, _ = block_inputs(tokens, anchors, cfg0.block_size, cfg0.mask_token_id)
    b = cfg0.block_size

    @jax.jit
    def alone(row_features, row_positions, anchor, tokens, positions):  # one block against its context
        cache = drafter.write_context(row_features, row_positions, drafter.init_cache(1, s))  # every position ...
        cache = cache._replace(lengths=jnp.full((1,), anchor, jnp.int32))  # ... and those before the anchor committed
        return target.vocab_logits(drafter(target.embed(tokens), positions, cache))[0]  # [B, V]

    for row in range(n):
        for j, a in enumerate(np.asarray(anchors[row])):
            got = alone(features[row : row + 1], positions[row : row + 1], a,
                        block[row : row + 1, j * b : (j + 1) * b], block_pos[row : row + 1, j * b : (j + 1) * b])
            np.testing.assert_allclose(np.asarray(logits[row, j]), np.asarray(got), atol=2e-5, rtol=1e-5,
                                       err_msg=f"row {row} anchor {a}")
            want = np.asarray(tokens[row, np.minimum(a + np.arange(b), s - 1)])
            np.testing.assert_array_equal(np.asarray(labels[row, j]), want)


def test_held_out_replay_scores_every_anchor_as_one_forward_does(setup, monkeypatch):
    """train.heldout's DFlash replay: drafted in chunks of rows and anchors (padding anchors, a last partial group),
    step k is right exactly where slot k's argmax over one forward of the sequence's every anchor is the data's
    token (only anchors whose x_{j+k} is a response token count), and the chains are replayed from those runs. On a
    text whose every response token past the first is the drafter's own first draft, every first draft is right."""
    from jaxspec.checkpoints.hf import load_target
    from jaxspec.config import DFlashConfig
    from jaxspec.models.dflash import DFlashDrafter
    from train import heldout
    from train.data import read_shards
    from train.dflash import block_logits

    cfg0 = DFlashConfig.for_target(load_target(setup / "target").config, num_layers=2, block_size=4)
    target = load_target(setup / "target", aux_layer_ids=cfg0.aux_layer_ids)
    target.numerics = None
    drafter = DFlashDrafter(cfg0, rngs=nnx.Rngs(3))
    sequences = [s[:2] for s in read_shards(setup / "data")]

    def features(ids):  # [1, n] -> the target's features at the drafter's layers
        n = ids.shape[1]
        return target(ids, jnp.arange(n)[None], target.init_cache(1, n), return_aux=True, empty_cache=True).aux

    @jax.jit
    def all_drafts(ids, anchors):  # one sequence [1, 32] (causal: the padding after it changes nothing), [1, 32]
        return jnp.argmax(block_logits(drafter, target, features(ids), ids, anchors)[0][0, :, 1:], axis=-1)

    right, counted, runs = np.zeros(3), np.zeros(3), []
    for tokens, mask in sequences:
        n, p = len(tokens), int(np.argmax(mask > 0))
        anchors = np.arange(p, n - 1)
        padded = np.zeros((2, 32), np.int32)
        padded[0, :n], padded[1, : len(anchors)] = tokens, anchors
        drafts = np.asarray(all_drafts(padded[:1], padded[1:]))[: len(anchors)]  # [A, 3]
        run = np.zeros(n, np.int64)
        for j, d in zip(anchors, drafts):
            at = j + 1 + np.arange(3)
            ok = (at < n) & (mask[np.minimum(at, n - 1)] > 0)
            hit = ok & (d == tokens[np.minimum(at, n - 1)])
            right += hit
            counted += ok
            run[j - 1] = np.cumprod(hit).sum()
        runs.append(run)
    whole = heldout.block_heldout_acceptance(target, drafter, sequences, 3)
    monkeypatch.setattr(heldout, "ROWS", 5)  # 24 sequences: 4 full groups and one of 4
    monkeypatch.setattr(heldout, "ANCHORS", 7)  # 6-23 anchors per sequence: 1-4 chunks, the last partly padding
    chunked = heldout.block_heldout_acceptance(target, drafter, sequences, 3)
    assert chunked == whole
    assert whole["positions"] == counted[0] == sum(len(t) - 6 for t, _ in sequences)
    assert whole["accuracy"] == pytest.approx(list(right / counted), abs=1e-4)
    for k in (1, 2, 3):
        assert whole[f"chain_{k}"] == pytest.approx(heldout.replay_chain(sequences, runs, k)[0], abs=1e-4)

    own = []  # x_{j+1} = the first draft at anchor j: 15 response tokens, the first a given one
    draft_of = jax.jit(lambda ids, j: jnp.argmax(block_logits(drafter, target, features(ids), ids, j[None, None])[0]
                                                 [0, 0, 1]))
    for tokens, _ in sequences[:3]:
        ids = np.zeros(20, np.int32)
        ids[:6] = tokens[:6]
        for j in range(5, 19):
            ids[j + 1] = draft_of(jnp.asarray(ids)[None], jnp.int32(j))
        own.append((ids, (np.arange(20) >= 5).astype(np.int32)))
    scored = heldout.block_heldout_acceptance(target, drafter, own, 3)
    assert scored["accuracy"][0] == 1.0 and scored["positions"] == 3 * 14
    assert scored["chain_1"] == 2.0  # 14 tokens after the prefill's, two per verify
    with pytest.raises(JaxspecError, match="blocks of 4 drafts 1 to 3 tokens per step; got 4"):
        heldout.block_heldout_acceptance(target, drafter, own, 4)


def test_batches_are_a_function_of_seed_and_step(setup):
    from train.data import read_shards

    seqs = read_shards(setup / "data")
    make = lambda: BlockBatches(seqs, seq_len=24, batch_size=4, num_anchors=8, seed=3)  # noqa: E731
    first, again = make(), make()
    seen = set()
    for step in range(8):  # 32 rows: past the first epoch of 24
        got, want = first(step), again(step)
        for field in ("ids", "loss_mask", "anchors", "anchor_valid"):
            np.testing.assert_array_equal(getattr(got, field), getattr(want, field))
        for r, i in enumerate(first.rows_of_step(step)):
            ids, mask, positions = first.rows[i]
            valid = got.anchors[r][got.anchor_valid[r]]
            assert len(valid) == min(8, len(positions)) and np.all(np.diff(valid) > 0)
            assert np.all(got.loss_mask[r, valid + 1] == 1)  # every real anchor's next token is trained
            np.testing.assert_array_equal(got.ids[r, : len(ids)], ids)
            if step < 6:
                seen.add(i)
    assert seen == set(range(len(seqs)))  # the first epoch is a permutation of every sequence
    np.testing.assert_array_equal(anchor_positions(np.array([0, 0, 1, 1, 0, 1])), [1, 2, 4])


def test_grouped_batches_are_as_wide_as_their_longest_row_and_train_the_same_blocks(setup):
    """group_by_length: each run of G batches' rows sorted by length, so a batch is only as wide as its longest
    row (rounded up to 64); an epoch still covers every sequence once, batches are still a function of (seed,
    step), and a trimmed batch's loss is the one its rows give at the full train.seq_len (padding never counts)."""
    from jaxspec.checkpoints.hf import load_target
    from jaxspec.config import DFlashConfig
    from jaxspec.models.dflash import DFlashDrafter
    from train.block_batches import WIDTH_MULTIPLE
    from train.dflash import block_loss

    rng = np.random.default_rng(0)
    seqs = []
    for n in rng.integers(8, 250, size=40):
        mask = np.zeros(n, np.int32)
        mask[n // 3 :] = 1
        seqs.append((rng.integers(0, 97, n).astype(np.int32), mask))
    grouped = BlockBatches(seqs, seq_len=256, batch_size=4, num_anchors=5, seed=2, group_by_length=3)
    plain = BlockBatches(seqs, seq_len=256, batch_size=4, num_anchors=5, seed=2)
    assert grouped.settings == {**plain.settings, "group_by_length": 3}
    assert sorted(i for step in range(10) for i in grouped.rows_of_step(step)) == list(range(40))
    widths = set()
    for step in range(10):
        batch, again = grouped(step), grouped(step)
        np.testing.assert_array_equal(batch.ids, again.ids)
        lengths = [len(grouped.rows[i][0]) for i in grouped.rows_of_step(step)]
        width = batch.ids.shape[1]
        assert width == min(256, -(-max(lengths) // WIDTH_MULTIPLE) * WIDTH_MULTIPLE)
        widths.add(width)
    assert len(widths) > 1
    padded = sum(b.ids.shape[1] for b in map(grouped, range(10))), sum(b.ids.shape[1] for b in map(plain, range(10)))
    assert padded[0] < 0.8 * padded[1]  # fewer padded positions
    # windows of 3 batches (12 rows) sorted: a batch's rows are consecutive in its window's length order
    window = [i for step in range(3) for i in grouped.rows_of_step(step)]
    by_batch = sorted((sorted(len(grouped.rows[i][0]) for i in window[j : j + 4]) for j in range(0, 12, 4)))
    assert all(a[-1] <= b[0] for a, b in zip(by_batch, by_batch[1:]))

    dcfg = DFlashConfig.for_target(load_target(setup / "target").config, num_layers=1, block_size=4)
    target = load_target(setup / "target", aux_layer_ids=dcfg.aux_layer_ids)
    target.numerics = None
    drafter = DFlashDrafter(dcfg, rngs=nnx.Rngs(1))
    trimmed = next(b for b in map(grouped, range(10)) if b.ids.shape[1] < 256)
    full = [np.zeros((4, 256), np.int32) for _ in range(2)]
    for arr, part in zip(full, (trimmed.ids, trimmed.loss_mask)):
        arr[:, : part.shape[1]] = part

    def loss(ids, mask):
        s = ids.shape[1]
        out = target(jnp.asarray(ids), jnp.broadcast_to(jnp.arange(s), ids.shape), target.init_cache(4, s),
                     return_aux=True, empty_cache=True)
        return block_loss(drafter, target, out.aux, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(trimmed.anchors),
                          4.0, jnp.asarray(trimmed.anchor_valid))[0]

    assert float(loss(trimmed.ids, trimmed.loss_mask)) == pytest.approx(float(loss(*full)), rel=1e-5)


def _config(setup, name: str, steps: int, **train) -> dict:
    return {
        "target": str(setup / "target"), "data": str(setup / "data"), "out": str(setup / name), "drafter": "dflash",
        "dflash": {"num_layers": 1, "block_size": 4, "num_anchors": 6, "loss_decay": 4.0},
        "train": {"num_draft_steps": 3, "batch_size": 4, "seq_len": 24, "steps": steps, "seed": 0,
                  "checkpoint_every": 2, "keep_checkpoints": 2, "log_every": 1, "compute_dtype": "float32", **train},
        "optim": {"learning_rate": 0.003, "warmup_steps": 2},
    }


def _losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_a_run_resumes_exactly_evaluates_and_exports_a_drafter_generate_loads(setup, monkeypatch, capsys):
    from train.config import parse_config
    from train.launch import run

    class ChatBytes(ByteTokenizer):
        chat_template = "the text itself"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return messages[0]["content"]

    from jaxspec import prompts as prompts_mod

    monkeypatch.setattr(prompts_mod, "load_tokenizer", lambda _: ChatBytes())
    evals = {"eval_every": 3, "eval_prompts": str(setup / "prompts.jsonl"), "eval_num_prompts": 2,
             "eval_max_new_tokens": 8, "eval_data": [str(setup / "data")]}
    class StopAfter:  # a stop request (Ctrl-C) that arrives during the given step
        def __init__(self, steps: int):
            self.left = steps

        def is_set(self) -> bool:
            self.left -= 1
            return self.left == 0

    run(parse_config(_config(setup, "straight", 6, **evals)))
    stopped = run(parse_config(_config(setup, "resumed", 6, **evals)), stop=StopAfter(4))
    assert stopped["interrupted"] and stopped["step"] == 3
    assert not (setup / "resumed" / "drafter-zlab").exists()  # an interrupted run exports nothing
    last = run(parse_config(_config(setup, "resumed", 6, **evals)))  # the same command again
    assert "resumed from step 4" in capsys.readouterr().err
    straight, resumed = _losses(setup / "straight"), _losses(setup / "resumed")
    assert sorted(straight) == sorted(resumed) == list(range(6))
    for step in range(6):
        assert resumed[step] == pytest.approx(straight[step], rel=1e-6, abs=1e-6)
    # random tokens: nothing to learn here (that the objective trains: tests/fit_head.py's fit_dflash, test_dflash)
    assert 1.0 <= last["accepted_length"] <= 4.0 and 0 <= last["acc_1"] <= 1
    assert last["eval_mean_accepted_length"] >= 1.0 and len(last["eval_acceptance_per_position"]) == 3

    # the export: z-lab's layout with the acceptance it measured, and the target's own text with it
    from jaxspec import generate
    from jaxspec.checkpoints.verifier import head_record
    from train import heldout
    from train.data import read_shards

    drafter_dir = setup / "resumed" / "drafter-zlab"
    config = json.loads((drafter_dir / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 4
    verifier, acceptance = head_record(config)
    assert verifier["num_hidden_layers"] == 4
    assert acceptance[0]["mean_accepted_length"] == max(1.0, last["eval_mean_accepted_length"])
    # the held-out replay of the last evaluation (step 6; the resumed run's own), recorded beside the engine's
    scored = last["heldout_data"]
    assert scored["positions"] == sum(len(s[0]) - 6 for s in read_shards(setup / "data"))
    assert acceptance[1]["measured_by"] == "train.heldout replay (teacher-forced) after step 6"
    assert acceptance[1]["mean_accepted_length"] == max(1.0, scored["chain_3"])
    # and the command scores the exported drafter the same way (its weights now bfloat16: the figures may move)
    cli = ["--draft", str(drafter_dir), "--target", str(setup / "target"), "--data", str(setup / "data")]
    assert heldout.main([*cli, "--num-draft", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["positions"] == scored["positions"] and len(out["accuracy"]) == 3 and out["chain_3"] >= 1.0
    with pytest.raises(SystemExit) as exit_:
        heldout.main([*cli, "--num-draft", "4"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == ("error: --num-draft 4: this DFlash drafter's blocks of 4 draft at "
                                               "most 3 tokens per step; pass --num-draft 3 or less")
    common = ["--target", str(setup / "target"), "--raw", "--json", "--prompt", "hello", "--max-new-tokens", "10"]
    outs = {}
    # a fixed chain: with the acceptance this drafter records (random data), auto rightly runs target-only
    for name, extra in (("none", ["--no-draft"]), ("dflash", ["--draft", str(drafter_dir), "--num-speculative-tokens",
                                                            "3"])):
        assert generate.main([*common, *extra]) == 0
        outs[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert outs["dflash"]["token_ids"] == outs["none"]["token_ids"] and outs["dflash"]["stats"]["proposer"] == "dflash+lookup"


def test_a_bfloat16_step_follows_the_float32_step_and_a_run_keeps_its_dtype(setup, capsys):
    """Mixed precision (train/precision.py): a step computing in bfloat16 (the target's copy, the drafter's params
    cast, the tied LM head's dot accumulated in float32) moves the float32 master weights as the float32 step does,
    within bfloat16's rounding; a run records its compute dtype and, resumed with `auto`, keeps it."""
    import functools

    from jaxspec.checkpoints.hf import load_target
    from jaxspec.config import DFlashConfig
    from jaxspec.models.dflash import DFlashDrafter
    import optax

    from train.config import parse_config
    from train.data import read_shards
    from train.dflash_run import BlockStep, dflash_step
    from train.launch import run
    from train.precision import computing_in

    dcfg = DFlashConfig.for_target(load_target(setup / "target").config, num_layers=1, block_size=4)
    target = load_target(setup / "target", aux_layer_ids=dcfg.aux_layer_ids)
    target.numerics = None
    drafter = DFlashDrafter(dcfg, rngs=nnx.Rngs(3))
    host = BlockBatches(read_shards(setup / "data"), seq_len=24, batch_size=4, num_anchors=6, seed=0)(0)
    batch = BlockStep(*(jnp.asarray(x) for x in (host.ids, host.loss_mask, host.anchors, host.anchor_valid)))
    tx = optax.sgd(0.01)  # the update is the gradient: compared directly
    dgd, params = nnx.split(drafter, nnx.Param)
    results = {}
    for dtype in ("float32", "bfloat16"):
        mixed = dtype == "bfloat16"
        tgd, tparams = nnx.split(computing_in(target, dtype) if mixed else target)
        step_dgd = nnx.split(computing_in(drafter, dtype), nnx.Param)[0] if mixed else dgd
        step = jax.jit(functools.partial(dflash_step, tgd, drafter_graphdef=step_dgd, tx=tx, loss_decay=4.0,
                                         compute_dtype=dtype if mixed else None))
        new, _, loss, _ = step(tparams, params=params, opt_state=tx.init(params), batch=batch)
        results[dtype] = (float(loss), new)
    (loss32, new32), (loss16, new16) = results["float32"], results["bfloat16"]
    assert loss16 == pytest.approx(loss32, rel=2e-2)
    moved32 = np.concatenate([np.ravel(a - b) for a, b in zip(jax.tree.leaves(new32), jax.tree.leaves(params))])
    moved16 = np.concatenate([np.ravel(a - b) for a, b in zip(jax.tree.leaves(new16), jax.tree.leaves(params))])
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(new16))  # the masters stay float32
    assert np.dot(moved32, moved16) / (np.linalg.norm(moved32) * np.linalg.norm(moved16)) > 0.98

    run(parse_config(_config(setup, "bf16", 2, compute_dtype="bfloat16")))
    assert "computing in bfloat16 (master weights float32" in capsys.readouterr().err
    run(parse_config(_config(setup, "bf16", 3, compute_dtype="auto")))  # auto on a resumed run: the recorded dtype
    err = capsys.readouterr().err
    assert "resumed from step 2" in err and "computing in bfloat16" in err


@pytest.mark.parametrize("change,message", [
    ({"train": {"num_draft_steps": 4}}, "train.num_draft_steps = 4 exceeds what a block of dflash.block_size = 4"),
    ({"head": {"draft_vocab_size": 48}}, "head is not for drafter: dflash"),
    ({"train": {"eval_every": 1, "eval_prompts": "mt_bench", "eval_trees": ["6,3,2"]}},
     "train.eval_trees is not for drafter: dflash"),
    ({"train": {"features": "offline"}}, "train.features is not for drafter: dflash"),
    ({"drafter": "eagle3"}, "the dflash: section shapes a block drafter; set drafter: dflash"),
    ({"dflash": {"block_size": 1}}, "dflash.block_size must be at least 2"),
])
def test_what_a_dflash_run_cannot_do_is_a_one_line_error(setup, change, message):
    from train.config import parse_config

    raw = _config(setup, "refused", 2)
    for key, value in change.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) and key in raw else value
    with pytest.raises(JaxspecError, match=message.replace(".", r"\.").replace("(", r"\(")):
        parse_config(raw)


def test_a_run_directory_of_another_drafter_is_refused(setup, tmp_path):
    """An EAGLE-3 run's checkpoints would not restore into a drafter's state (and would be set aside as unreadable):
    refused before anything loads."""
    from train.config import parse_config
    from train.launch import run

    (tmp_path / "checkpoints" / "4").mkdir(parents=True)  # an EAGLE-3 run's checkpoint directory
    raw = _config(setup, "unused", 2)
    raw["out"] = str(tmp_path)
    with pytest.raises(JaxspecError, match="holds the checkpoints of a eagle3 run, and this config trains drafter: "
                                           "dflash; use another out"):
        run(parse_config(raw))
    assert (tmp_path / "checkpoints" / "4").is_dir()


def test_dflash_yaml_of_the_builtin_target_parses():
    """configs/smollm2-dflash.yaml (the built-in drafter's recipe) is a valid config."""
    from pathlib import Path

    from train.config import load_config

    path = Path(__file__).resolve().parents[1] / "configs" / "smollm2-dflash.yaml"
    cfg = load_config(path)
    assert cfg.drafter == "dflash" and cfg.dflash.block_size >= 2 and yaml.safe_load(path.read_text())["dflash"]
