"""Sequence packing for head training: several self-distilled sequences share one fixed-length row.

Padding every sequence to `seq_len` spent a quarter of each step on padding (responses average ~240 tokens, rows
were 320), and every position ran all K draft steps although only response positions carry a loss. A packed row
holds whole sequences back to back, each with its own positions (0, 1, ...) and segment id, so attention never
crosses a sequence boundary. Alongside it go the *trained positions*: those whose draft steps count in the loss
(row t of step k is taught where the token t+2+k is a response token of the same sequence). Only those run the
draft steps past step 0's keys (`train.ttt`), so prompt positions cost a key and a value, not a full head forward;
the packer keeps each row's trained positions within a fixed capacity so that every batch has one shape.

Packing is a pure function of the data, the settings and (seed, epoch): an epoch is a seeded permutation of the
sequences placed first-fit into rows, so the batch of step s — and a resumed run — depends only on (seed, s) for
given data and settings (`PackedBatches.settings`, which train.launch keeps in its checkpoints).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxspec.errors import JaxspecError

MAX_OPEN = 64  # rows first-fit may still add to: bounds the scan per sequence


def trained_positions(loss_mask: np.ndarray, num_steps: int) -> np.ndarray:
    """Positions t of one sequence where some draft step k < num_steps is trained: loss_mask[t+2+k] for a k."""
    n = len(loss_mask)
    m = np.concatenate([np.asarray(loss_mask, bool), np.zeros(num_steps + 2, bool)])
    hit = np.zeros(n, bool)
    for k in range(num_steps):
        hit |= m[2 + k : 2 + k + n]
    return np.flatnonzero(hit)


def first_fit(order, sizes: np.ndarray, budget: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Items (in `order`) packed into rows whose summed sizes [n, d] stay within `budget` [d]: each item goes to
    the oldest open row with room. A row closes when the smallest item could no longer fit its first budget, or
    when more than MAX_OPEN rows are open (the oldest). Rows come in the order they were opened."""
    rows: list[list[int]] = []
    room: list[np.ndarray] = []
    open_rows: list[int] = []
    smallest = int(sizes[:, 0].min())
    for i in order:
        need = sizes[i]
        r = next((r for r in open_rows if (room[r] >= need).all()), None)
        if r is None:
            r = len(rows)
            rows.append([])
            room.append(np.array(budget))
            open_rows.append(r)
        rows[r].append(int(i))
        room[r] = room[r] - need
        if room[r][0] < smallest:
            open_rows.remove(r)
        if len(open_rows) > MAX_OPEN:
            open_rows.pop(0)
    return tuple(tuple(r) for r in rows)


def layout(members, lengths) -> list[tuple[int, int, int, int]]:
    """(segment id 1, 2, .., sequence index, start, length) of each sequence of a packed row, back to back."""
    out, start = [], 0
    for seg, i in enumerate(members, start=1):
        n = int(lengths[i])
        out.append((seg, i, start, n))
        start += n
    return out


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """Host arrays of one step. Positions past the last sequence of a row are padding (segment 0, mask 0)."""

    ids: np.ndarray  # [B, T] int32
    loss_mask: np.ndarray  # [B, T] int32, 1 on response tokens
    positions: np.ndarray  # [B, T] int32, restarting at 0 for each sequence
    segments: np.ndarray  # [B, T] int32, 1, 2, ... per sequence in the row; 0 on padding
    trained: np.ndarray  # [B, C] int32 positions that carry a loss, ascending; unused slots hold T-1 (never do)
    aux: np.ndarray | None = None  # [B, T, n_aux·H] offline features
    hidden: np.ndarray | None = None  # [B, T, H]

    @property
    def real_tokens(self) -> int:
        return int((self.segments > 0).sum())


class PackedBatches:
    """The batch of step s, from first-fit packing of a seeded permutation of the sequences per epoch.

    sequences: (ids, loss_mask[, aux, hidden]) per sequence; sequences longer than seq_len, or with more trained
    positions than `capacity`, are cut. capacity: trained positions per row (C); None: seq_len."""

    def __init__(self, sequences, seq_len: int, batch_size: int, num_steps: int, seed: int,
                 capacity: int | None = None):
        if not sequences:
            raise JaxspecError("the training data holds no sequences")
        self.sequences, self.seq_len, self.batch_size, self.seed = sequences, seq_len, batch_size, seed
        self.capacity = capacity or seq_len
        # what the data order depends on, besides the data: a resumed run must see the same (train.launch checks)
        self.settings = {"seed": seed, "seq_len": seq_len, "batch_size": batch_size, "num_draft_steps": num_steps,
                         "trained_positions": self.capacity, "num_sequences": len(sequences)}
        self.lengths = np.array([min(len(s[0]), seq_len) for s in sequences])
        self.trained_per_sequence = []
        for i, s in enumerate(sequences):
            p = trained_positions(s[1][: self.lengths[i]], num_steps)
            if len(p) > self.capacity:  # cut like a sequence longer than seq_len: keep the first `capacity`
                self.lengths[i] = p[self.capacity] + 2  # p[capacity] itself needs x_{p+2}, now past the end
                p = trained_positions(s[1][: self.lengths[i]], num_steps)
            self.trained_per_sequence.append(p)
        self.sizes = np.stack([self.lengths, [len(p) for p in self.trained_per_sequence]], axis=1)  # [n, 2]
        self.cut_tokens = int(sum(len(s[0]) for s in sequences) - self.lengths.sum())
        self.row_counts: list[int] = []  # packed rows of each epoch so far (kept: it locates any step)
        self.packed: dict[int, tuple[tuple[int, ...], ...]] = {}  # the last few epochs' packings

    def epoch_rows(self, epoch: int) -> tuple[tuple[int, ...], ...]:
        """The epoch's packed rows (sequence indices each), in the order their first sequence was drawn."""
        while len(self.row_counts) <= epoch:  # earlier epochs first: their row counts locate later steps
            self.row_counts.append(len(self._pack(len(self.row_counts))))
        return self._pack(epoch)

    def _pack(self, epoch: int) -> tuple[tuple[int, ...], ...]:
        if epoch not in self.packed:
            if len(self.packed) >= 3:  # a run reads its current epoch and the next
                self.packed.pop(min(self.packed))
            order = np.random.default_rng((self.seed, epoch)).permutation(len(self.sequences))
            self.packed[epoch] = first_fit(order, self.sizes, (self.seq_len, self.capacity))
        return self.packed[epoch]

    def locate(self, row: int) -> tuple[int, int]:
        """(epoch, index within it) of the row-th packed row of the run, the epochs laid end to end."""
        epoch = 0
        while True:
            if epoch == len(self.row_counts):
                self.epoch_rows(epoch)
            if row < self.row_counts[epoch]:
                return epoch, row
            row -= self.row_counts[epoch]
            epoch += 1

    def rows_of_step(self, step: int) -> list[tuple[int, ...]]:
        """The B packed rows of step s."""
        out = []
        epoch, j = self.locate(step * self.batch_size)
        while len(out) < self.batch_size:
            rows = self.epoch_rows(epoch)
            take = rows[j : j + self.batch_size - len(out)]
            out += take
            epoch, j = (epoch + 1, 0) if j + len(take) >= len(rows) else (epoch, j + len(take))
        return out

    def epoch_of_step(self, step: int) -> float:
        """How many epochs the first `step` steps cover (for logs)."""
        epoch, j = self.locate(step * self.batch_size)
        return epoch + j / self.row_counts[epoch]

    def __call__(self, step: int) -> PackedBatch:
        b, t, c = self.batch_size, self.seq_len, self.capacity
        ids = np.zeros((b, t), np.int32)
        mask, positions, segments = np.zeros_like(ids), np.zeros_like(ids), np.zeros_like(ids)
        trained = np.full((b, c), t - 1, np.int32)
        feats = len(self.sequences[0]) > 2
        aux = hidden = None
        if feats:
            first = self.sequences[0]
            aux = np.zeros((b, t, first[2].shape[-1]), first[2].dtype)
            hidden = np.zeros((b, t, first[3].shape[-1]), first[3].dtype)
        for r, members in enumerate(self.rows_of_step(step)):
            used = 0
            for seg, i, start, n in layout(members, self.lengths):
                seq = self.sequences[i]
                ids[r, start : start + n] = seq[0][:n]
                mask[r, start : start + n] = seq[1][:n]
                positions[r, start : start + n] = np.arange(n)
                segments[r, start : start + n] = seg
                if feats:
                    aux[r, start : start + n] = seq[2][:n]
                    hidden[r, start : start + n] = seq[3][:n]
                p = self.trained_per_sequence[i]
                trained[r, used : used + len(p)] = start + p
                used += len(p)
        return PackedBatch(ids, mask, positions, segments, trained, aux, hidden)
