"""The draft vocabulary: the V_d most frequent target tokens among trained (assistant) tokens, sorted ascending.

d2t[i] = selected[i] - i maps draft id i back to its target id; t2d[v] says whether target token v is draftable.
"""

from __future__ import annotations

import numpy as np

from jaxspec.errors import JaxspecError


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
