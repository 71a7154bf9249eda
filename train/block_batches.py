"""Batches for block drafters (DFlash): one self-distilled sequence per row and anchors drawn in its responses.

A block drafter learns, at an anchor a, the tokens x_{a+1} .. x_{a+B-1} from the context before a and x_a itself
(train/dflash.py). Its context is whatever came before a in the row, so a row holds one sequence (packing two
would hand the second one's blocks the first one's text as context), padded or cut to seq_len. Anchors are the
positions whose next token is a response token; each row draws `num_anchors` of them without replacement (DFlash's
recipe: many blocks per sequence in one forward, BLOCK_DRAFTERS.md §1.5), and a sequence with fewer fills the rest
with weightless padding anchors.

Like `train.packing`, the batch of step s is a pure function of the data, the settings and (seed, s): an epoch is a
seeded permutation of the sequences, and the anchors of a row are drawn from (seed, s, row). A killed run resumes
with the same batches (`BlockBatches.settings`, which train.launch keeps in its checkpoints).

Grouping by length (`group_by_length` = G batches): each run of G·B rows of an epoch's permutation is sorted by
length, cut into G batches and those shuffled, and a batch is only as wide as its longest row (rounded up to a
multiple of WIDTH_MULTIPLE): one sequence per row leaves most of a fixed-width row padding (the self-distilled
data: 46% of 8 × 512 real), which the target's forward and the drafter's context attention pay for; grouped in
16 batches, 85%. Each width compiles its own step (at most seq_len / WIDTH_MULTIPLE of them).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxspec.errors import JaxspecError

WIDTH_MULTIPLE = 64  # a grouped batch's width: its longest row rounded up to this (few compiled shapes)


def anchor_positions(loss_mask: np.ndarray) -> np.ndarray:
    """Positions a of one sequence whose next token x_{a+1} is trained (loss_mask[a + 1] = 1)."""
    m = np.asarray(loss_mask, bool)
    return np.flatnonzero(m[1:])


@dataclasses.dataclass(frozen=True)
class BlockBatch:
    """Host arrays of one step; positions past a row's sequence are padding (token 0, mask 0)."""

    ids: np.ndarray  # [B, S] int32
    loss_mask: np.ndarray  # [B, S] int32, 1 on response tokens
    anchors: np.ndarray  # [B, A] int32, ascending within the real ones
    anchor_valid: np.ndarray  # [B, A] bool: False for padding anchors (weightless)
    real_tokens: int  # tokens of the sequences, padding not counted


class BlockBatches:
    """The batch of step s: rows in a seeded permutation of the sequences per epoch, anchors seeded per row.

    sequences: (ids, loss_mask, ...) per sequence; those longer than seq_len are cut, and those left without an
    anchor (no response token after the first position) are dropped."""

    def __init__(self, sequences, seq_len: int, batch_size: int, num_anchors: int, seed: int,
                 group_by_length: int = 0):
        self.seq_len, self.batch_size, self.num_anchors, self.seed = seq_len, batch_size, num_anchors, seed
        self.group_by_length = group_by_length  # G batches sorted by length together; 0: off (fixed seq_len)
        self.rows = []  # (ids, loss_mask, anchor positions) of each kept sequence, cut to seq_len
        for seq in sequences:
            ids, mask = np.asarray(seq[0][:seq_len], np.int32), np.asarray(seq[1][:seq_len], np.int32)
            anchors = anchor_positions(mask)
            if len(anchors):
                self.rows.append((ids, mask, anchors))
        if not self.rows:
            raise JaxspecError(f"no training sequence has a response token after its first position within "
                               f"train.seq_len = {seq_len}: nothing to train a block drafter on")
        self.cut_tokens = int(sum(max(len(s[0]) - seq_len, 0) for s in sequences))
        self.dropped = len(sequences) - len(self.rows)
        # what the data order depends on, besides the data: a resumed run must see the same (train.launch checks)
        self.settings = {"seed": seed, "seq_len": seq_len, "batch_size": batch_size, "num_anchors": num_anchors,
                         "num_sequences": len(sequences)}
        if group_by_length:  # (absent when off: runs saved before grouping existed resume unchanged)
            self.settings["group_by_length"] = group_by_length
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) >= 3:  # a run reads its current epoch and the next
                self._orders.pop(min(self._orders))
            order = np.random.default_rng((self.seed, epoch)).permutation(len(self.rows))
            if self.group_by_length:
                order = self._grouped(order, epoch)
            self._orders[epoch] = order
        return self._orders[epoch]

    def _grouped(self, order: np.ndarray, epoch: int) -> np.ndarray:
        """Each run of G·B rows of `order` sorted by length, cut into batches of B, the batches shuffled."""
        b, window = self.batch_size, self.group_by_length * self.batch_size
        lengths = np.asarray([len(self.rows[i][0]) for i in order])
        out = []
        for w, start in enumerate(range(0, len(order), window)):
            part = order[start : start + window][np.argsort(lengths[start : start + window], kind="stable")]
            batches = [part[j : j + b] for j in range(0, len(part), b)]
            for k in np.random.default_rng((self.seed, epoch, w)).permutation(len(batches)):
                out.append(batches[k])
        return np.concatenate(out)

    def rows_of_step(self, step: int) -> list[int]:
        """Indices (into the kept sequences) of step s's B rows: the epochs laid end to end."""
        n = len(self.rows)
        return [int(self._order(r // n)[r % n]) for r in range(step * self.batch_size, (step + 1) * self.batch_size)]

    def epoch_of_step(self, step: int) -> float:
        """How many epochs the first `step` steps cover (for logs)."""
        return step * self.batch_size / len(self.rows)

    def __call__(self, step: int) -> BlockBatch:
        b, s, a = self.batch_size, self.seq_len, self.num_anchors
        rows = self.rows_of_step(step)
        if self.group_by_length:  # as wide as the longest row (rounded up), never wider than seq_len
            longest = max(len(self.rows[i][0]) for i in rows)
            s = min(s, -(-longest // WIDTH_MULTIPLE) * WIDTH_MULTIPLE)
        ids, mask = np.zeros((b, s), np.int32), np.zeros((b, s), np.int32)
        anchors, valid = np.zeros((b, a), np.int32), np.zeros((b, a), bool)
        real = 0
        for r, i in enumerate(rows):
            seq_ids, seq_mask, positions = self.rows[i]
            n = len(seq_ids)
            ids[r, :n], mask[r, :n] = seq_ids, seq_mask
            real += n
            rng = np.random.default_rng((self.seed, step, r))
            drawn = np.sort(rng.choice(positions, size=min(a, len(positions)), replace=False))
            anchors[r, : len(drawn)], valid[r, : len(drawn)] = drawn, True
        return BlockBatch(ids, mask, anchors, valid, real)
