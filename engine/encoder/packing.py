"""Packed encoder batches: several inputs share a row, and a program is a token count.

A padded grid ([batch bucket] x [length bucket]) needs a program per pair: 35 for
MiniLM, each compiled before the shape is first served. Packed, one program holds
`rows` rows of `width` tokens, and each row holds as many inputs, back to back, as
fit; every token carries the slot (the output row) of its input and its position
inside that input. Attention stays inside a slot (engine/encoder/model.py masks the
rest), so an input embeds as it would alone. The shapes are a short ladder of token
counts (`ladder`): 16, 32, ... up to the model's limit as single rows, then at the
token budget 16 rows of 64 (short inputs) and 2, 4, ... rows of the limit: 8
programs for MiniLM (limit 256, budget 1,024), and for limits 128 to 512.

The cost: a token attends to every key of its row, its own input's only counting.
Measured on MiniLM, 64 queries of 15 tokens packed into 256-token rows ran at 0.77x
the grid's 64 x 16 (softmax and small-K attention over 256 keys, not 16); in
64-token rows the waste is 4x16 keys. Padding, which the grid wastes twice (batch
and length), falls to what the last row leaves over: 64 inputs of mixed length
(15-200 tokens) ran at 1.23x the grid. numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

SMALLEST = 16  # tokens of the smallest program: one short query
NARROW = 64  # row width of the full-size program for short inputs (queries, titles)


@dataclass(frozen=True, order=True)
class Shape:
    """One compiled program: `rows` rows of `width` tokens and `slots` outputs."""

    tokens: int  # rows * width
    rows: int
    width: int
    slots: int  # inputs it holds at most (its output rows)

    @property
    def name(self) -> str:
        return f"{self.rows}x{self.width}"


def ladder(max_tokens: int, budget: int | None, max_batch: int) -> tuple[Shape, ...]:
    """The programs of a model whose inputs hold at most `max_tokens` tokens, groups
    at most `budget` tokens (None: one row of the limit) and calls `max_batch` inputs:
    single rows 16, 32, ... up to the limit (one request's latency), then at the
    budget rows of `NARROW` tokens (short inputs: a token attends 64 keys, not the
    limit's) and rows of the limit, 2, 4, ... of them (long ones)."""
    widths = []
    t = SMALLEST
    while t < max_tokens:
        widths.append(t)
        t *= 2
    out = [Shape(w, 1, w, min(max_batch, w)) for w in widths + [max_tokens]]
    if budget and NARROW < max_tokens and budget >= 2 * NARROW:
        rows = budget // NARROW
        out.append(Shape(rows * NARROW, rows, NARROW, min(max_batch, rows * NARROW)))
    rows = 2
    while budget and rows * max_tokens <= budget:
        out.append(Shape(rows * max_tokens, rows, max_tokens, min(max_batch, rows * max_tokens)))
        rows *= 2
    return tuple(sorted(out))


@dataclass
class Group:
    """Inputs placed into one program: input `index[k]` fills row `row[k]` from
    column `col[k]` and comes out as the program's output row k."""

    shape: Shape
    index: list[int]
    row: list[int]
    col: list[int]

    def arrays(self, inputs: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, ...]:
        """(ids, slot, pos), each int32 [rows, width]: the tokens, the output row each
        token belongs to (`slots` for padding) and its position inside its input."""
        s = self.shape
        ids = np.full((s.rows, s.width), pad_id, dtype=np.int32)
        slot = np.full((s.rows, s.width), s.slots, dtype=np.int32)
        pos = np.zeros((s.rows, s.width), dtype=np.int32)
        for k, (i, r, c) in enumerate(zip(self.index, self.row, self.col)):
            n = len(inputs[i])
            ids[r, c : c + n] = inputs[i]
            slot[r, c : c + n] = k
            pos[r, c : c + n] = np.arange(n)
        return ids, slot, pos

    def place(self, values: Sequence[Sequence[int]], fill: int = 0) -> np.ndarray:
        """Per-token values of the inputs (a pair's token types) in this layout."""
        s = self.shape
        out = np.full((s.rows, s.width), fill, dtype=np.int32)
        for i, r, c in zip(self.index, self.row, self.col):
            out[r, c : c + len(values[i])] = values[i]
        return out


def _fill(order: list[int], lengths: Sequence[int], shape: Shape) -> tuple[Group, list[int]]:
    """First fit of `order` (longest first) into the rows of `shape` -> (the group,
    the inputs left over)."""
    free = [shape.width] * shape.rows
    group, rest = Group(shape, [], [], []), []
    for i in order:
        n = lengths[i]
        r = next((r for r in range(shape.rows) if free[r] >= n), -1)
        if r < 0 or len(group.index) == shape.slots:
            rest.append(i)
            continue
        group.index.append(i)
        group.row.append(r)
        group.col.append(shape.width - free[r])
        free[r] -= n
    return group, rest


def plan(lengths: Sequence[int], shapes: Sequence[Shape]) -> list[Group]:
    """Inputs -> groups, each on one of `shapes` (ascending): the smallest program
    that holds all that is left, else the largest filled and the rest again. Every
    length must fit the widest shape's rows (the caller checked the limit)."""
    shapes = sorted(shapes, key=lambda s: (s.tokens, s.width))  # narrow rows first
    widest = max(s.width for s in shapes)
    if lengths and max(lengths) > widest:
        raise ValueError(f"an input of {max(lengths)} tokens fits no program (widest {widest})")
    left = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[Group] = []
    while left:
        total = sum(lengths[i] for i in left)
        for shape in shapes:
            if shape.tokens < total or shape.slots < len(left) or shape.width < lengths[left[0]]:
                continue
            group, rest = _fill(left, lengths, shape)
            if not rest:
                groups.append(group)
                return groups
        top = max(s.tokens for s in shapes if s.width >= lengths[left[0]])
        fits = [s for s in shapes if s.tokens == top and s.width >= lengths[left[0]]]
        group, left = _fill(left, lengths, min(fits, key=lambda s: s.width))  # the longest fits
        groups.append(group)
    return groups
