"""Sequence packing: several examples per row, so a batch of short examples is not mostly padding.

    rows = data.encode(tokenizer, records, template, L)     # one example per row, [N, L+1]
    packed = packing.pack_rows(rows)                         # several per row, [M, L+1], M <= N

Each example keeps the KerasHub layout it had alone (BOS + text + EOS) and is placed whole in a
row; a row holds examples back to back, then padding. `segment_ids` numbers the examples of a
row 1, 2, ... (0 = padding) and `positions` restarts at 0 with each example, so the model
(`Gemma.__call__(..., segment_ids=, positions=)`) lets a token see only earlier tokens of its
own example, at the RoPE positions it had alone (RoPE depends on position differences only, so
this keeps the rotation angles, and their rounding, those of the example alone). The first token of an example is never a
target (it would be predicted from the previous example), so its `loss_mask` is cleared; all
other targets keep the weight they had alone. Loss and gradients therefore equal those of the
same examples unpacked (tests/test_packing.py checks it on a sharded step).

Packing is best-fit decreasing (longest example first, into the row it leaves least room in),
deterministic in the data alone: it runs once, and batches are drawn from the packed rows by
`batch_rows(rows, step, seed=...)` as before, so a resumed run reads what an uninterrupted one
would.
"""
from __future__ import annotations

import numpy as np

def assign(lengths: np.ndarray, width: int) -> list[list[int]]:
    """Example indices per row: best-fit decreasing over `lengths` (each <= width).

    Rows with free space are kept in buckets by how much they have left; the smallest space that
    fits an example is the lowest set bit >= its length in a bit set of the non-empty buckets,
    so an example costs O(1) big-int operations, not a scan over rows (240k examples: ~1 s).
    """
    order = np.argsort(-np.asarray(lengths), kind="stable")  # ties keep the data order
    buckets: list[list[int]] = [[] for _ in range(width + 1)]  # space left -> rows
    open_spaces = 0  # bit s set iff buckets[s] is non-empty
    rows: list[list[int]] = []
    for e in order.tolist():
        n = int(lengths[e])
        if n > width:
            raise ValueError(f"example {e} has {n} tokens, more than the row width {width}")
        fits = open_spaces >> n
        if fits:
            space = n + (fits & -fits).bit_length() - 1
            row = buckets[space].pop()
            if not buckets[space]:
                open_spaces &= ~(1 << space)
        else:
            space, row = width, len(rows)
            rows.append([])
        rows[row].append(e)
        left = space - n
        if left:
            buckets[left].append(row)
            open_spaces |= 1 << left
    return rows


def pack_rows(rows: dict[str, np.ndarray], multiple_of: int = 1) -> dict[str, np.ndarray]:
    """One-example rows [N, W] ({"token_ids", "padding_mask"[, "loss_mask"]}, right-padded) ->
    packed rows [M, W] with the same keys plus "segment_ids" and "positions" (int32).

    A missing loss_mask is padding_mask (every real token scored). multiple_of: M is rounded up
    with empty rows (they score nothing), e.g. to the mesh's batch axis for an exactness test.
    """
    ids, mask = rows["token_ids"], rows["padding_mask"].astype(bool)
    loss = rows.get("loss_mask", mask).astype(bool)
    lengths = mask.sum(1)
    if not (mask == (np.arange(mask.shape[1])[None, :] < lengths[:, None])).all():
        raise ValueError("pack_rows needs right-padded rows (real tokens first, then padding)")
    width = ids.shape[1]
    assignment = assign(lengths, width)
    m = -(-len(assignment) // multiple_of) * multiple_of
    pad = ids[~mask][0] if (~mask).any() else 0
    out = {"token_ids": np.full((m, width), pad, ids.dtype), "padding_mask": np.zeros((m, width), bool),
           "loss_mask": np.zeros((m, width), bool), "segment_ids": np.zeros((m, width), np.int32),
           "positions": np.zeros((m, width), np.int32)}
    for r, examples in enumerate(assignment):
        at = 0
        for segment, e in enumerate(examples, start=1):
            n = int(lengths[e])
            out["token_ids"][r, at:at + n] = ids[e, :n]
            out["padding_mask"][r, at:at + n] = True
            out["loss_mask"][r, at + 1:at + n] = loss[e, 1:n]  # the first token is no target
            out["segment_ids"][r, at:at + n] = segment
            out["positions"][r, at:at + n] = np.arange(n)
            at += n
    return out

