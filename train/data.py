"""Training data for EAGLE-3 heads: prompts → responses written by the target itself (self-distillation).

On-disk format (one directory per dataset):
  meta.json            target name, chat template flag, generation settings, shard size, prompt order seed
  shard-00000.npz      tokens [N] int32 (sequences concatenated), offsets [n+1] int64, prompt_lens [n] int32,
                       ids [n] str, finished [n] bool (the response ended with a stop token)
  features-00000.aux.npy, features-00000.hidden.npy
                       optional (`python -m train.data features`): aux [N, n_aux·H] and hidden [N, H], bfloat16 bits
                       as uint16, the target's EAGLE-3 features and final pre-norm hidden state for every token of the
                       shard, for offline training of heads for small targets (the teacher logits are
                       lm_head(norm(hidden))). Plain .npy, read memory-mapped: a whole dataset's features (~4.6 kB
                       per token for SmolLM2, 17 GB for 3.7M tokens) need not fit in memory.
Sequence i is tokens[offsets[i]:offsets[i+1]]: the chat-formatted prompt followed by the target's greedy response;
its loss mask is 1 on the response (positions ≥ prompt_lens[i]). Shards are written atomically (temporary file,
then rename) and cover fixed slices of a seeded shuffle of the prompts, so a killed run resumes by skipping the
shards that exist, and host h of n takes shards h, h+n, ... .

  python -m train.data prompts --out FILE.jsonl --count N [--exclude mt_bench gsm8k]   (train/self_prompts.py)
  python -m train.data generate [--prompts train|FILE.jsonl] [--exclude mt_bench gsm8k] --out DIR [--limit N] ...
  python -m train.data features --data DIR [--target DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxspec.errors import JaxspecError
from train.self_prompts import write_prompts

BF16 = np.dtype(ml_dtypes.bfloat16)


def load_prompts(path: str | Path, seed: int, exclude: list[str | Path] = ()) -> list[tuple[str, str]]:
    """(id, prompt) pairs in a seeded shuffle (sources mixed), minus any prompt text found in `exclude` files."""
    from jaxspec.prompts import excluded_prompts, prompt_set_path, read_prompts_file

    banned = excluded_prompts(exclude)
    prompts = [(pid, text) for pid, text in read_prompts_file(prompt_set_path(path)) if text.strip() not in banned]
    order = np.random.default_rng(seed).permutation(len(prompts))
    return [prompts[i] for i in order]


def check_shard_prompts(out: Path, prompts: list[tuple[str, str]], shard_size: int) -> None:
    """Each shard already in `out` must hold the prompts this run assigns to it (a smaller --limit may leave more in
    the last one). Why: a resumed run skips the shards that exist, so a prompts file that grew (a rerun of
    `train.data prompts`) or another --exclude would shuffle other prompts into them, and the dataset would silently
    repeat some prompts and miss others."""
    for i in range(-(-len(prompts) // shard_size)):
        path = shard_path(out, i)
        if not path.exists():
            continue
        held = [str(x) for x in load_npz(path, "ids")[0]]  # a shard cut short by a full disk: one line
        expected = [pid for pid, _ in prompts[i * shard_size : (i + 1) * shard_size]]
        if held[: len(expected)] != expected:  # a last shard written under a larger --limit may hold more
            raise JaxspecError(
                f"{path} holds other prompts than --prompts, --exclude, --seed and --limit now assign to it "
                "(the prompts changed since it was written); use a new --out"
            )


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


def shard_files(directory: str | Path) -> list[Path]:
    return [p for p in sorted(Path(directory).glob("shard-*.npz")) if not p.name.endswith(".tmp.npz")]


def features_paths(shard: Path) -> tuple[Path, Path]:
    """(aux, hidden) feature files of a shard; the hidden file is written last, so its presence means both are."""
    stem = shard.name.replace("shard-", "features-").removesuffix(".npz")
    return shard.with_name(stem + ".aux.npy"), shard.with_name(stem + ".hidden.npy")


def has_features(shard: Path) -> bool:
    return all(p.is_file() for p in features_paths(shard))


FEATURES_META = "features.json"  # in a dataset directory: the target whose features its shards hold


def features_quantization(directory: Path) -> str | None:
    """How the target that computed a dataset's cached features had its weights quantized (int8, fp8; None: as
    stored, also for features cached before this was recorded)."""
    meta = Path(directory) / FEATURES_META
    from jaxspec.files import read_json

    return read_json(meta, "the features' features.json").get("quantize") if meta.is_file() else None


def check_features_quantization(directories, quantize: str | None) -> None:
    """Offline training reads cached features: they must come from the verifier the config trains for."""
    for d in directories:
        found = features_quantization(d)
        if found != quantize:
            raise JaxspecError(
                f"the features cached in {str(d)!r} come from the target {weights_phrase(found)}, and target.quantize asks "
                f"for it {weights_phrase(quantize)}: recompute them (python -m train.data features"
                f"{f' --quantize {quantize}' if quantize else ''}, after deleting features-*.npy) or set "
                f"target.quantize: {found or 'null'}"
            )


def check_heldout_quantization(directories, quantize: str | None) -> None:
    """Held-out replay (train/heldout.py) scores drafts against the data's next tokens, which are the target's
    own greedy output only if the same target wrote them: data generated by the float target would score an int8
    target's head against another model's tokens."""
    from jaxspec.files import read_json

    for d in directories:
        meta = Path(d) / "meta.json"
        found = read_json(meta, "the dataset's meta.json").get("quantize") if meta.is_file() else None
        if found != quantize:
            raise JaxspecError(
                f"the held-out responses in {str(d)!r} were written by the target {weights_phrase(found)}, and this run "
                f"scores the target {weights_phrase(quantize)}: the replay needs its own greedy output (python -m "
                f"train.data generate{f' --quantize {quantize}' if quantize else ''} --prompts SET --out DIR)"
            )


def weights_phrase(quantize: str | None) -> str:
    """How a target's weights were taken, for messages: 'quantized to int8' or 'as stored'."""
    return f"quantized to {quantize}" if quantize else "as stored"


def require_shards(directory: str | Path, what: str = "data shards") -> list[Path]:
    """The shard files of a dataset directory; a one-line error if it is missing, not a directory or empty."""
    d = Path(directory)
    hint = "python -m train.data generate --out DIR writes them"
    if not d.exists():
        raise JaxspecError(f"data directory {str(d)!r} does not exist ({hint})")
    if not d.is_dir():
        raise JaxspecError(f"data path {str(d)!r} is not a directory ({hint})")
    shards = shard_files(d)
    if not shards:
        raise JaxspecError(f"data directory {str(d)!r} holds no {what} (shard-*.npz; {hint})")
    return shards


def load_npz(path: Path, *names: str) -> list[np.ndarray]:
    """The named arrays of a .npz file, each read once; a damaged or incomplete file is a one-line error."""
    try:
        with np.load(path) as f:
            absent = [name for name in names if name not in f.files]
            if absent:
                raise JaxspecError(f"{str(path)!r} lacks array {absent[0]!r} (not written by train.data?)")
            return [f[name] for name in names]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise JaxspecError(f"cannot read {str(path)!r}: {e} (delete it and run the command again)") from None


def read_shards(directory: str | Path, with_features: bool = False) -> list[tuple]:
    """All (tokens, loss_mask) sequences of a dataset directory, in shard order; with_features adds each
    sequence's (aux, hidden) arrays from the features files (an error if a shard has none)."""
    out = []
    for path in shard_files(directory):
        feats = None
        if with_features:
            if not has_features(path):
                raise JaxspecError(f"{path.name} has no features files (run python -m train.data features)")
            aux, hidden = (load_npy(f).view(BF16) for f in features_paths(path))  # memory-mapped
            feats = {"aux": aux, "hidden": hidden}
        tokens, offsets, plens = load_npz(path, "tokens", "offsets", "prompt_lens")
        if feats is not None and len(feats["aux"]) != len(tokens):
            raise JaxspecError(f"{path.name}'s features cover {len(feats['aux'])} tokens, not {len(tokens)} "
                               "(delete its features files and run python -m train.data features)")
        for i in range(len(plens)):
            a, b = offsets[i], offsets[i + 1]
            seq = tokens[a:b]
            mask = (np.arange(len(seq)) >= plens[i]).astype(np.int32)
            if feats is None:
                out.append((seq, mask))
            else:
                out.append((seq, mask, feats["aux"][a:b], feats["hidden"][a:b]))
    return out


def load_npy(path: Path) -> np.ndarray:
    """A .npy file memory-mapped; a damaged one is a one-line error."""
    try:
        return np.load(path, mmap_mode="r")
    except (OSError, ValueError, EOFError) as e:
        raise JaxspecError(f"cannot read {str(path)!r}: {e} (delete it and run the command again)") from None


def save_npy(path: Path, array: np.ndarray) -> None:
    """Write atomically: a temporary file, then a rename (a killed run leaves no half-written file behind)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


def compute_features(args) -> None:
    """Run the target over every shard and store its features and final hidden states (bfloat16).

    A shard's sequences are packed into rows of --seq-len tokens (longest first, first-fit; each attends only to
    itself), so no compute goes to padding and one forward shape compiles once."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tqdm import tqdm

    from jaxspec.checkpoints.hf import load_target
    from jaxspec.cli.loading import resolve_target
    from train.packing import first_fit, layout
    from train.precision import computing_in, resolve_compute_dtype
    from train.step import target_features

    shards = require_shards(args.data)
    todo = [p for p in shards if not has_features(p)]
    found = features_quantization(args.data)
    if len(todo) < len(shards) and found != args.quantize:  # one dataset's features all come from one target
        raise JaxspecError(
            f"{args.data} holds features of the target {weights_phrase(found)}; delete its features-*.npy to cache them "
            f"{weights_phrase(args.quantize)}, or run with{f' --quantize {found}' if found else 'out --quantize'}"
        )
    (Path(args.data) / FEATURES_META).write_text(json.dumps({"quantize": args.quantize}) + "\n")
    if not todo:
        print(f"all {len(shards)} shards in {args.data} have features", file=sys.stderr)
        return
    target = load_target(resolve_target(args.target), quantize=args.quantize)
    target.numerics = None  # features are values for training: plain XLA numerics, no batch-invariance needed
    cfg = target.config
    b, t = args.batch_size, args.seq_len
    # The features are stored in bfloat16 either way; computing them in bfloat16 (float32 sums) is what an online
    # bfloat16 training step does, and on accelerators and AMX CPUs about twice as fast (train/precision.py).
    compute = resolve_compute_dtype(args.compute_dtype, b * t, cfg.hidden_size, cfg.intermediate_size)
    if jnp.dtype(compute) != target.dtype:
        target = computing_in(target, compute)
    print(f"computing features in {compute} (--compute-dtype {args.compute_dtype})", file=sys.stderr)
    graphdef, state = nnx.split(target)

    @jax.jit
    def forward(state, ids, positions, segments):  # [B, T] each → aux [B, T, n_aux·H], hidden [B, T, H] bfloat16
        aux, hidden = target_features(nnx.merge(graphdef, state), ids, positions, segments)
        return aux.astype(jnp.bfloat16), hidden.astype(jnp.bfloat16)

    for path in tqdm(todo, desc="features", unit="shard"):
        tokens, offsets = load_npz(path, "tokens", "offsets")
        aux_out = np.zeros((len(tokens), len(cfg.aux_layer_ids) * cfg.hidden_size), BF16)
        hid_out = np.zeros((len(tokens), cfg.hidden_size), BF16)
        lengths = np.diff(offsets)
        short = np.flatnonzero(lengths <= t)
        packed = first_fit(short[np.argsort(-lengths[short], kind="stable")], lengths[:, None], (t,))
        groups = [(b, t, packed[i : i + b]) for i in range(0, len(packed), b)]
        # a sequence longer than a row runs alone, in a row of the next power of two
        groups += [(1, 1 << (int(lengths[i]) - 1).bit_length(), [(int(i),)]) for i in np.flatnonzero(lengths > t)]
        for num_rows, width, batch in groups:
            ids, positions, segments = (np.zeros((num_rows, width), np.int32) for _ in range(3))
            rows = [layout(members, lengths) for members in batch]
            for r, row in enumerate(rows):
                for seg, i, at, n in row:
                    ids[r, at : at + n] = tokens[offsets[i] : offsets[i + 1]]
                    positions[r, at : at + n], segments[r, at : at + n] = np.arange(n), seg
            aux, hid = (np.asarray(x) for x in forward(state, *(jnp.asarray(x) for x in (ids, positions, segments))))
            for r, row in enumerate(rows):
                for _, i, at, n in row:
                    a = offsets[i]
                    aux_out[a : a + n], hid_out[a : a + n] = aux[r, at : at + n], hid[r, at : at + n]
        aux_path, hidden_path = features_paths(path)
        save_npy(aux_path, aux_out.view(np.uint16))
        save_npy(hidden_path, hid_out.view(np.uint16))  # last: its presence means the shard is done


def generate(args) -> None:
    from tqdm import tqdm

    from jaxspec.cli.loading import kernels_impl, load_target_and_tokenizer, resolve_target
    from jaxspec.config import load_target_config
    from jaxspec.engine.generation import Generator
    from jaxspec.cli.outputs import check_output_dir
    from jaxspec.files import make_dir, read_json
    from jaxspec.prompts import encode_prompt, load_tokenizer, prompt_set_path, stop_token_ids

    if args.host_index >= args.num_hosts:
        raise JaxspecError(
            f"--host-index must be in 0..{args.num_hosts - 1} (--num-hosts {args.num_hosts}), got {args.host_index}"
        )
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise JaxspecError(f"--out {str(out)!r} exists and is not a directory")
    check_output_dir(out, holds_own=lambda d: (d / "meta.json").is_file() or any(d.glob("shard-*.npz")),
                     what="dataset (no meta.json, no shards)", overwrite=False,
                     fix="pass a new or empty directory, or the --out of an earlier run to resume it")
    # The inputs are checked before anything is written.
    prompts = load_prompts(args.prompts, args.seed, args.exclude)
    if args.limit:
        prompts = prompts[: args.limit]
    if not prompts:
        raise JaxspecError(f"every prompt of {args.prompts!r} is in an --exclude file: nothing to generate")
    target_dir = resolve_target(args.target)
    load_target_config(target_dir)  # a missing or broken --target fails here, not after writing meta.json
    make_dir(out, "--out")
    meta = {
        "target": target_dir.name,
        "prompts": prompt_set_path(args.prompts).name,
        "seed": args.seed,
        "shard_size": args.shard_size,
        "max_new_tokens": args.max_new_tokens,
        "quantize": args.quantize,  # the target's weights as generated from (null: as stored)
        "decoding": "greedy",
        "chat_template": True,
        "num_prompts": len(prompts),
    }
    meta_file = out / "meta.json"
    if meta_file.is_file():
        old = read_json(meta_file, "the dataset's meta.json")
        changed = {k for k in ("target", "seed", "shard_size", "max_new_tokens", "quantize") if old.get(k) != meta[k]}
        if changed:
            raise JaxspecError(
                f"{out} was generated with other settings ({', '.join(sorted(changed))}); use a new --out"
            )
    check_shard_prompts(out, prompts, args.shard_size)  # before meta.json is rewritten
    num_shards = -(-len(prompts) // args.shard_size)
    mine = [i for i in range(num_shards) if i % args.num_hosts == args.host_index and not shard_path(out, i).exists()]
    if mine:
        tokenizer = load_tokenizer(target_dir)
        try:  # the answers are a chat model's: no chat template fails here, before anything is written
            encode_prompt(tokenizer, prompts[0][1], raw=False)
        except JaxspecError:
            raise JaxspecError(f"the target {target_dir.name!r} has no chat template; train.data generates a chat "
                               "model's answers: use an instruct target") from None
    meta_file.write_text(json.dumps(meta, indent=2))
    if not mine:
        print(f"all {num_shards} shards exist in {out}", file=sys.stderr)
        return
    model, tokenizer = load_target_and_tokenizer(
        target_dir, args.dtype, numerics=args.numerics, kernels=kernels_impl(args), quantize=args.quantize,
        tokenizer=tokenizer,
    )
    stops = stop_token_ids(tokenizer, target_dir, model.config.eos_token_ids)
    gen = Generator(model, batch_size=args.batch_size)
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


def _positive_float(text: str) -> float:
    """argparse type: a float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from jaxspec.cli.args import SEED_RANGE, OneLineParser, add_target_args, integer

    parser = OneLineParser(prog="python -m train.data", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser(
        "generate",
        help="write self-distilled responses in resumable shards",
        description="Write the target's greedy responses to the prompts in resumable shards of --out.",
    )
    add_target_args(
        g, numerics="plain",
        numerics_why=". Training data needs no batch-invariance, and plain numerics generate a batch several times "
        "faster on CPU",
    )
    g.add_argument(
        "--prompts",
        default="train",
        metavar="NAME|FILE.jsonl",
        help="training prompts: a set shipped with jaxspec (train: 17.5k GSM8K-train, CodeAlpaca, T0, Self-Instruct "
        "and Alpaca prompts) or a JSONL file in MT-Bench, {id, prompt}, HumanEval or GSM8K form (default: train)",
    )
    g.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="the dataset directory; a rerun resumes into it (required; no default)",
    )
    g.add_argument(
        "--exclude",
        nargs="*",
        default=[],
        metavar="NAME|FILE",
        help="prompt sets (mt_bench, gsm8k: the shipped evaluation sets) or files whose prompts are kept out "
        "(default: none)",
    )
    g.add_argument(
        "--limit",
        type=integer(0),
        default=0,
        metavar="N",
        help="use the first N prompts of the shuffle, 0 = all (default: %(default)s)",
    )
    g.add_argument("--seed", type=integer(0, SEED_RANGE[1]), default=0,
                   help="seed of the prompt shuffle (default: %(default)s)")
    g.add_argument(
        "--shard-size", type=integer(1), default=64, metavar="N", help="prompts per shard (default: %(default)s)"
    )
    g.add_argument(
        "--batch-size",
        type=integer(1),
        default=32,
        metavar="B",
        help="prompts generated together (default: %(default)s)",
    )
    g.add_argument(
        "--max-new-tokens",
        type=integer(1),
        default=192,
        metavar="N",
        help="longest response in tokens (default: %(default)s)",
    )
    g.add_argument(
        "--host-index",
        type=integer(0),
        default=0,
        metavar="H",
        help="this host's index: it writes shards H, H+N, ... (default: %(default)s)",
    )
    g.add_argument(
        "--num-hosts", type=integer(1), default=1, metavar="N", help="hosts sharing the work (default: %(default)s)"
    )
    pr = sub.add_parser(
        "prompts",
        help="sample user prompts from the target's own chat template (Magpie), to generate from",
        description="Write --count distinct user prompts that the target samples after its chat template's "
        "user-turn header (train/self_prompts.py) to a JSONL file that generate --prompts reads; a rerun continues it.",
    )
    add_target_args(pr, numerics="plain", numerics_why=". Sampled prompts need no batch-invariance")
    pr.add_argument("--out", required=True, metavar="FILE.jsonl", help="the prompts file (required; no default)")
    pr.add_argument("--count", type=integer(1), required=True, metavar="N",
                    help="distinct prompts to write (required; no default)")
    pr.add_argument("--seed", type=integer(0), default=0, metavar="S",
                    help="each round samples with a seed hashed from (S, round); a second file that excludes a first "
                    "needs another S (default: %(default)s)")
    pr.add_argument(
        "--temperature", type=_positive_float, default=1.0, metavar="T",
        help="sampling temperature, > 0 (default: %(default)s)",
    )
    pr.add_argument("--top-p", type=_positive_float, default=0.95, metavar="P",
                    help="nucleus sampling, in (0, 1] (default: %(default)s)")
    pr.add_argument(
        "--max-tokens", type=integer(1), default=128, metavar="N",
        help="longest prompt; a turn the target has not ended by then is dropped (default: %(default)s)",
    )
    pr.add_argument("--batch-size", type=integer(1), default=32, metavar="B",
                    help="turns sampled per round (default: %(default)s)")
    pr.add_argument(
        "--exclude", nargs="*", default=[], metavar="NAME|FILE",
        help="prompt sets or files whose prompts are dropped if sampled (default: none)",
    )
    f = sub.add_parser(
        "features",
        help="cache the target's features per shard (offline training, small targets)",
        description="Store the target's EAGLE-3 features and final hidden states next to each shard of --data.",
    )
    add_target_args(f, generates=False)  # the features are computed in --compute-dtype with plain numerics
    f.add_argument(
        "--data", required=True, metavar="DIR", help="a dataset directory written by generate (required; no default)"
    )
    f.add_argument(
        "--batch-size", type=integer(1), default=4, metavar="B", help="packed rows per forward (default: %(default)s)"
    )
    f.add_argument(
        "--seq-len", type=integer(2), default=512, metavar="T",
        help="tokens per packed row; a longer sequence runs alone in a row of the next power of two "
        "(default: %(default)s)",
    )
    f.add_argument(
        "--compute-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
        help="dtype the target computes the features in (stored in bfloat16 either way); auto: bfloat16 on GPU/TPU "
        "and on CPUs where a timed bfloat16 matmul is faster, as train.compute_dtype (default: %(default)s)",
    )
    return parser


def main(argv=None) -> int:
    from jaxspec.cli.program import main_guard, use_compile_cache

    parser = build_parser()

    def run(argv):
        args = parser.parse_args(argv)
        use_compile_cache(args)
        {"generate": generate, "features": compute_features, "prompts": write_prompts}[args.command](args)
        return 0

    return main_guard(run)(argv)


if __name__ == "__main__":
    from jaxspec.cli.program import run_program

    run_program(main)
