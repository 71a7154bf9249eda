"""python -m train.launch --config configs/NAME.yaml [key.sub=value ...]: train an EAGLE-3 head with TTT.

Reads self-distilled shards (train/data.py), builds the draft vocabulary from their response tokens, trains with the
frozen target computing features online, checkpoints with orbax (a killed run resumes exactly: the batch of step
s is a pure function of the seed and s), logs metrics to <out>/metrics.jsonl (and TensorBoard when tensorboardX is
installed), measures real mean accepted length
with the speculative engine every eval_every steps, and exports the head in the speculators and SGLang layouts.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import numpy as np
import yaml

from jaxspec.errors import JaxspecError


def load_config(path: str, overrides: list[str]) -> dict:
    file = Path(path)
    if not file.is_file():
        raise JaxspecError(f"config {path!r} does not exist")
    cfg = yaml.safe_load(file.read_text()) or {}
    for item in overrides:
        if "=" not in item:
            raise JaxspecError(f"override {item!r} is not key=value (e.g. train.steps=100)")
        key, value = item.split("=", 1)
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)
    return cfg


class Batches:
    """Fixed-length batches (ids, loss_mask[, aux, hidden]); the batch of step s depends only on (seed, s)."""

    def __init__(self, sequences, seq_len: int, batch_size: int, seed: int):
        if not sequences:
            raise JaxspecError("the training data holds no sequences")
        self.sequences, self.seq_len = sequences, seq_len
        self.batch_size, self.seed = batch_size, seed

    def rows(self, step: int) -> list[int]:
        n, b = len(self.sequences), self.batch_size
        rows = []
        for j in range(step * b, (step + 1) * b):
            epoch, pos = divmod(j, n)
            rows.append(int(np.random.default_rng((self.seed, epoch)).permutation(n)[pos]))
        return rows

    def __call__(self, step: int) -> tuple:
        """Padded (ids, mask) arrays [B, T], plus (aux, hidden) [B, T, *] when the data carries features."""
        rows = [self.sequences[i] for i in self.rows(step)]
        out = []
        for field in range(len(rows[0])):
            first = rows[0][field]
            arr = np.zeros((len(rows), self.seq_len, *first.shape[1:]), np.int32 if field < 2 else first.dtype)
            for i, r in enumerate(rows):
                k = min(len(r[field]), self.seq_len)
                arr[i, :k] = r[field][:k]
            out.append(arr)
        return tuple(out)


def build_head(target, cfg: dict, counts: np.ndarray, seed: int, prior: np.ndarray | None = None):
    import jax.numpy as jnp
    from flax import nnx

    from jaxspec.config import HeadConfig
    from jaxspec.models.eagle3 import Eagle3Head
    from train.vocab import build_vocab_map

    t = target.config
    hcfg = cfg.get("head", {})
    vd = int(hcfg.get("draft_vocab_size") or t.vocab_size)
    d2t, _ = build_vocab_map(counts, vd, prior)
    head_cfg = HeadConfig(
        hidden_size=t.hidden_size, num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, head_dim=t.head_dim,
        intermediate_size=int(hcfg.get("intermediate_size") or t.intermediate_size), vocab_size=t.vocab_size,
        draft_vocab_size=vd, target_hidden_size=t.hidden_size, rms_norm_eps=t.rms_norm_eps, rope=t.rope,
        aux_layer_ids=t.aux_layer_ids,
    )
    head = Eagle3Head(head_cfg, dtype=target.dtype, rngs=nnx.Rngs(seed))
    head.d2t.set_value(jnp.asarray(d2t, jnp.int32))
    if hcfg.get("init_lm_head_from_target", True):
        rows = np.arange(vd) + d2t
        table = target.embed_tokens[...] if target.lm_head is None else target.lm_head.kernel[...].T
        head.lm_head.kernel.set_value(jnp.asarray(table[rows].T))
    return head


def evaluate(target, head, tokenizer, target_dir, cfg: dict) -> float:
    """Mean accepted length (tokens per verify, bonus included) on the first prompts of the eval file."""
    from jaxspec.prompts import encode_prompt, read_prompts_file, stop_token_ids
    from jaxspec.spec.generator import SpeculativeGenerator

    t = cfg["train"]
    prompts = read_prompts_file(Path(t["eval_prompts"]).expanduser())[: t.get("eval_num_prompts", 8)]
    encoded = [encode_prompt(tokenizer, text, raw=False) for _, text in prompts]
    stops = stop_token_ids(tokenizer, target_dir, target.config.eos_token_ids)
    gen = SpeculativeGenerator(target, head, num_draft=t["num_draft_steps"], batch_size=len(encoded))
    out = gen.generate(encoded, max_new_tokens=t.get("eval_max_new_tokens", 64), stop_ids=stops)
    calls = sum(c.stats["target_calls"] - 1 for c in out)
    return (sum(c.num_generated for c in out) - len(out)) / max(calls, 1)


def _tensorboard(out: Path):
    """A TensorBoard writer on <out>/tensorboard when tensorboardX is installed (the JSONL log is always written)."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(out / "tensorboard"))


def run(cfg: dict) -> dict:
    import jax
    from flax import nnx
    from tqdm import tqdm

    from jaxspec.checkpoints.heads import export_head
    from jaxspec.checkpoints.hf import load_target
    from jaxspec.cli_common import resolve_target
    from train.checkpointing import RunCheckpoints
    from train.data import read_shards
    from train.step import (
        Batch,
        OptimConfig,
        batch_sharding,
        make_mesh,
        make_optimizer,
        param_sharding,
        split_head,
        train_step,
    )
    from train.vocab import coverage, token_counts

    t = cfg["train"]
    if cfg.get("distributed"):  # multi-host (a TPU slice, several GPU hosts): one process per host
        jax.distributed.initialize()
    out = Path(cfg["out"]).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    target_dir = resolve_target(cfg.get("target"))
    target = load_target(target_dir)
    target.numerics = None  # the teacher's logits and features only need their values: plain XLA numerics, faster
    data_dir = Path(cfg["data"]).expanduser()
    offline = t.get("features", "online") == "offline"
    sequences = read_shards(data_dir, with_features=offline)
    if not sequences:
        raise JaxspecError(f"no training shards in {str(data_dir)!r} (run python -m train.data generate first)")
    # The draft vocabulary comes from all but every 20th sequence; its coverage of those held out says how often
    # a target token cannot be drafted at all (a cap on acceptance).
    vocab = target.config.vocab_size
    counts = token_counts((s[0] for i, s in enumerate(sequences) if i % 20), (s[1] for i, s in enumerate(sequences) if i % 20), vocab)
    held_out = token_counts((s[0] for s in sequences[::20]), (s[1] for s in sequences[::20]), vocab)
    # Prompt tokens too rank the tokens responses never used (a small dataset leaves many such ties).
    every_token = token_counts((s[0] for i, s in enumerate(sequences) if i % 20), (np.ones_like(s[0]) for i, s in enumerate(sequences) if i % 20), vocab)
    head = build_head(target, cfg, counts, t.get("seed", 0), prior=every_token)
    draft_mask = np.zeros(vocab, bool)
    draft_mask[np.asarray(head.to_target_ids(np.arange(head.config.draft_vocab_size)))] = True
    print(f"{len(sequences)} sequences, {int(counts.sum() + held_out.sum())} response tokens; draft vocabulary "
          f"{head.config.draft_vocab_size} covers {coverage(counts, draft_mask):.4f} of training tokens and "
          f"{coverage(held_out, draft_mask):.4f} of held-out ones", file=sys.stderr)

    optim = OptimConfig(**{**cfg.get("optim", {}), "total_steps": t["steps"]})
    tx = make_optimizer(optim)
    tgd, tparams = nnx.split(target)
    hgd, params, frozen = split_head(head, optim.freeze_lm_head)
    mesh_cfg = cfg.get("mesh", {}) or {}
    mesh = make_mesh(int(mesh_cfg.get("data", 1)), int(mesh_cfg.get("fsdp", 1)))
    tparams = jax.device_put(tparams, param_sharding(mesh, tparams))
    params = jax.device_put(params, param_sharding(mesh, params))
    frozen = jax.device_put(frozen, param_sharding(mesh, frozen))
    opt_state = jax.jit(tx.init)(params)
    state = {"params": params, "opt_state": opt_state}

    ckpt = RunCheckpoints(out / "checkpoints", keep=t.get("keep_checkpoints", 3))
    start = 0
    if ckpt.latest_step() is not None:
        state, meta = ckpt.restore(ckpt.latest_step(), state)
        start = meta["next_step"]
        print(f"resumed from step {start}", file=sys.stderr)
    batches = Batches(sequences, t["seq_len"], t["batch_size"], t.get("seed", 0))
    step_fn = jax.jit(
        functools.partial(train_step, tgd, head_graphdef=hgd, tx=tx, num_steps=t["num_draft_steps"]),
        donate_argnames=("params", "opt_state"),
    )
    metrics_file = (out / "metrics.jsonl").open("a")
    board = _tensorboard(out)
    params, opt_state = state["params"], state["opt_state"]
    last = {}
    for step in tqdm(range(start, t["steps"]), initial=start, total=t["steps"], desc="train", unit="step"):
        arrays = batches(step)
        ids = arrays[0]
        batch = jax.device_put(Batch(*arrays), batch_sharding(mesh))
        begin = time.perf_counter()
        params, opt_state, loss, metrics = step_fn(tparams, params=params, frozen=frozen, opt_state=opt_state, batch=batch)
        loss = float(loss)
        record = {"step": step, "loss": loss, **{k: round(float(v), 5) for k, v in metrics.items()},
                  "tokens_per_second": round(ids.size / (time.perf_counter() - begin), 1)}
        if t.get("eval_every") and (step + 1) % t["eval_every"] == 0:
            from jaxspec.prompts import load_tokenizer

            merged = nnx.merge(hgd, params, frozen)
            record["eval_mean_accepted_length"] = round(evaluate(target, merged, load_tokenizer(target_dir), target_dir, cfg), 4)
        if step % t.get("log_every", 10) == 0 or "eval_mean_accepted_length" in record or step == t["steps"] - 1:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
            if board is not None:
                for name, value in record.items():
                    if name != "step":
                        board.add_scalar(f"train/{name}", value, step)
                board.flush()
        if (step + 1) % t.get("checkpoint_every", 100) == 0 or step == t["steps"] - 1:
            ckpt.save(step + 1, {"params": params, "opt_state": opt_state}, {"next_step": step + 1})
        last = record
    metrics_file.close()
    if board is not None:
        board.close()
    ckpt.close()
    head = nnx.merge(hgd, params, frozen)
    for layout in ("speculators", "sglang"):
        export_head(head, out / f"head-{layout}", layout=layout, target=target.config, dtype="bfloat16")
    return last


def main(argv=None) -> int:
    from jaxspec.cli_common import main_guard

    parser = argparse.ArgumentParser(prog="python -m train.launch", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, metavar="FILE.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value")

    @main_guard
    def _main(argv):
        args = parser.parse_args(argv)
        run(load_config(args.config, args.overrides))
        return 0

    return _main(argv)


if __name__ == "__main__":
    sys.exit(main())
