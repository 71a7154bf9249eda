"""The draft vocabulary: the V_d most frequent target tokens among trained (assistant) tokens, sorted ascending.

d2t[i] = selected[i] - i maps draft id i back to its target id; t2d[v] says whether target token v is draftable.

  python -m train.vocab --data DIR [--eval DIR ...] [--sizes 8192,16384,32768]
prints how much of the held-out training responses and of each evaluation set's responses (shards written by
`python -m train.data generate`) a draft vocabulary of each size covers: a token outside it can never be drafted.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from jaxspec.errors import JaxspecError

HELD_OUT_EVERY = 20  # every 20th sequence is held out of the vocabulary counts, to measure coverage on unseen text


def token_counts(sequences, masks, vocab_size: int) -> np.ndarray:
    """Frequencies [V] of the tokens where the mask is set, over an iterable of (ids, mask) arrays."""
    counts = np.zeros(vocab_size, np.int64)
    for ids, mask in zip(sequences, masks):
        ids = np.asarray(ids)
        np.add.at(counts, ids[np.asarray(mask, bool)], 1)
    return counts


def build_vocab_map(
    counts: np.ndarray, draft_vocab_size: int, prior: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(d2t [V_d] int64, t2d [V] bool) from token counts; ties (notably the many tokens never seen in responses of
    a small dataset) broken by `prior` counts (e.g. over prompt text too), then by the lower token id."""
    vocab = counts.shape[0]
    if not 0 < draft_vocab_size <= vocab:
        raise JaxspecError(f"draft vocabulary size {draft_vocab_size} must be in 1..{vocab}")
    prior = np.zeros_like(counts) if prior is None else prior
    order = np.lexsort((np.arange(vocab), -prior, -counts))  # most frequent first, then prior, then lower id
    selected = np.sort(order[:draft_vocab_size])
    d2t = (selected - np.arange(draft_vocab_size)).astype(np.int64)
    t2d = np.zeros(vocab, bool)
    t2d[selected] = True
    return d2t, t2d


def coverage(counts: np.ndarray, t2d: np.ndarray) -> float:
    """Fraction of counted tokens the draft vocabulary can propose (caps the acceptance of every draft)."""
    total = counts.sum()
    return float(counts[t2d].sum() / total) if total else 0.0


def training_counts(sequences, vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(response-token counts of all but every HELD_OUT_EVERY-th sequence, those of the held-out ones, counts of
    every token of the kept sequences — the prior that ranks tokens responses never used) from (ids, mask, ...)."""
    kept = [s for i, s in enumerate(sequences) if i % HELD_OUT_EVERY]
    held = sequences[::HELD_OUT_EVERY]
    counts = token_counts((s[0] for s in kept), (s[1] for s in kept), vocab_size)
    held_out = token_counts((s[0] for s in held), (s[1] for s in held), vocab_size)
    prior = token_counts((s[0] for s in kept), (np.ones_like(s[0]) for s in kept), vocab_size)
    return counts, held_out, prior


def main(argv=None) -> int:
    from jaxspec.cli.args import positive_int_list
    from jaxspec.cli.program import main_guard

    parser = argparse.ArgumentParser(prog="python -m train.vocab", description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, metavar="DIR", help="training shards (required; no default)")
    parser.add_argument("--eval", nargs="*", default=[], metavar="DIR",
                        help="shards of evaluation sets' responses, e.g. written by `python -m train.data generate "
                        "--prompts mt_bench` (default: none)")
    parser.add_argument("--sizes", type=positive_int_list, default=[8192, 16384, 32768], metavar="N,N",
                        help="draft vocabulary sizes to compare (default: 8192,16384,32768)")

    @main_guard
    def run(argv):
        from train.data import read_shards, require_shards

        args = parser.parse_args(argv)
        sizes = args.sizes
        require_shards(args.data, "training shards")
        sequences = read_shards(args.data)
        evals = {}
        for d in args.eval:
            require_shards(d, "evaluation shards")
            evals[d] = read_shards(d)
        # tokens never seen count zero: the vocabulary needs only cover the ids present and the sizes asked for
        seen = max(int(s[0].max()) for seqs in [sequences, *evals.values()] for s in seqs if len(s[0]))
        vocab = max(seen + 1, *sizes)
        counts, held_out, prior = training_counts(sequences, vocab)
        names = ["held-out training responses", *evals]
        print("| draft vocabulary | " + " | ".join(names) + " |")
        print("|---" * (len(names) + 1) + "|")
        for size in sizes:
            _, t2d = build_vocab_map(counts, size, prior)
            cells = [coverage(held_out, t2d)]
            cells += [coverage(token_counts((s[0] for s in e), (s[1] for s in e), vocab), t2d) for e in evals.values()]
            print(f"| {size} | " + " | ".join(f"{c:.4f}" for c in cells) + " |")
        return 0

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
