"""Training data for EAGLE-3 heads: prompts → responses written by the target itself (self-distillation).

On-disk format (one directory per dataset):
  meta.json            target name, chat template flag, generation settings, shard size, prompt order seed
  shard-00000.npz      tokens [N] int32 (sequences concatenated), offsets [n+1] int64, prompt_lens [n] int32,
                       ids [n] str, finished [n] bool (the response ended with a stop token)
Sequence i is tokens[offsets[i]:offsets[i+1]]: the chat-formatted prompt followed by the target's greedy response;
its loss mask is 1 on the response (positions ≥ prompt_lens[i]). Shards are written atomically (temporary file,
then rename) and cover fixed slices of a seeded shuffle of the prompts, so a killed run resumes by skipping the
shards that exist, and host h of n takes shards h, h+n, ... .

  python -m train.data generate --prompts ../shared/data/train_prompts.jsonl --out DIR [--limit N] ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from jaxspec.errors import JaxspecError


def load_prompts(path: str | Path, seed: int, exclude: list[str | Path] = ()) -> list[tuple[str, str]]:
    """(id, prompt) pairs in a seeded shuffle (sources mixed), minus any prompt text found in `exclude` files."""
    from jaxspec.prompts import read_prompts_file

    banned = {text.strip() for f in exclude for _, text in read_prompts_file(f)}
    prompts = [(pid, text) for pid, text in read_prompts_file(path) if text.strip() not in banned]
    order = np.random.default_rng(seed).permutation(len(prompts))
    return [prompts[i] for i in order]


def shard_path(out: Path, index: int) -> Path:
    return out / f"shard-{index:05d}.npz"


def write_shard(path: Path, sequences: list[list[int]], prompt_lens: list[int], ids: list[str], finished: list[bool]):
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in sequences])]).astype(np.int64)
    tmp = path.with_suffix(".tmp.npz")
    np.savez_compressed(
        tmp,
        tokens=np.concatenate([np.asarray(s, np.int32) for s in sequences]),
        offsets=offsets,
        prompt_lens=np.asarray(prompt_lens, np.int32),
        ids=np.asarray(ids),
        finished=np.asarray(finished, bool),
    )
    os.replace(tmp, path)


def read_shards(directory: str | Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """All (tokens, loss_mask) sequences of a dataset directory, in shard order."""
    out = []
    for path in sorted(Path(directory).glob("shard-*.npz")):
        if path.name.endswith(".tmp.npz"):
            continue
        with np.load(path) as shard:
            tokens, offsets, plens = shard["tokens"], shard["offsets"], shard["prompt_lens"]
            for i in range(len(plens)):
                seq = tokens[offsets[i] : offsets[i + 1]]
                mask = (np.arange(len(seq)) >= plens[i]).astype(np.int32)
                out.append((seq, mask))
    return out


def generate(args) -> None:
    from tqdm import tqdm

    from jaxspec.cli_common import load_target_and_tokenizer, resolve_target
    from jaxspec.generation import TargetGenerator
    from jaxspec.prompts import encode_prompt, stop_token_ids

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(args.prompts, args.seed, args.exclude)
    if args.limit:
        prompts = prompts[: args.limit]
    target_dir = resolve_target(args.target)
    meta = {
        "target": target_dir.name, "prompts": Path(args.prompts).name, "seed": args.seed, "shard_size": args.shard_size,
        "max_new_tokens": args.max_new_tokens, "decoding": "greedy", "chat_template": True, "num_prompts": len(prompts),
    }
    meta_file = out / "meta.json"
    if meta_file.is_file():
        old = json.loads(meta_file.read_text())
        changed = {k for k in ("target", "seed", "shard_size", "max_new_tokens") if old.get(k) != meta[k]}
        if changed:
            raise JaxspecError(f"{out} was generated with other settings ({', '.join(sorted(changed))}); use a new --out")
    meta_file.write_text(json.dumps(meta, indent=2))

    num_shards = -(-len(prompts) // args.shard_size)
    mine = [i for i in range(num_shards) if i % args.num_hosts == args.host_index and not shard_path(out, i).exists()]
    if not mine:
        print(f"all {num_shards} shards exist in {out}", file=sys.stderr)
        return
    model, tokenizer = load_target_and_tokenizer(target_dir, args.dtype)
    stops = stop_token_ids(tokenizer, target_dir, model.config.eos_token_ids)
    gen = TargetGenerator(model, batch_size=args.batch_size)
    limit = model.config.context_length - args.max_new_tokens
    for i in tqdm(mine, desc="shards", unit="shard"):
        chunk = prompts[i * args.shard_size : (i + 1) * args.shard_size]
        encoded = [encode_prompt(tokenizer, text, raw=False)[:limit] for _, text in chunk]
        order = np.argsort([len(e) for e in encoded])  # similar lengths share a batch: less padding
        done = gen.generate([encoded[j] for j in order], max_new_tokens=args.max_new_tokens, stop_ids=stops)
        responses = [None] * len(chunk)
        for j, c in zip(order, done):
            responses[j] = c
        write_shard(
            shard_path(out, i),
            [e + c.token_ids for e, c in zip(encoded, responses)],
            [len(e) for e in encoded],
            [pid for pid, _ in chunk],
            [c.finished_by_eos for c in responses],
        )


def main(argv=None) -> int:
    from jaxspec.cli_common import add_target_args, main_guard

    parser = argparse.ArgumentParser(prog="python -m train.data", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="write self-distilled responses in resumable shards")
    add_target_args(g)
    g.add_argument("--prompts", required=True, metavar="FILE.jsonl")
    g.add_argument("--out", required=True, metavar="DIR")
    g.add_argument("--exclude", nargs="*", default=[], metavar="FILE", help="prompt files to keep out (eval sets)")
    g.add_argument("--limit", type=int, default=0, help="use the first N prompts of the shuffle (0 = all)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--shard-size", type=int, default=64)
    g.add_argument("--batch-size", type=int, default=32)
    g.add_argument("--max-new-tokens", type=int, default=192)
    g.add_argument("--host-index", type=int, default=0)
    g.add_argument("--num-hosts", type=int, default=1)
    return main_guard(lambda argv: generate(parser.parse_args(argv)) or 0)(argv)


if __name__ == "__main__":
    sys.exit(main())
