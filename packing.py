"""Sequence packing for training: which rows go into one forward/backward, and how they are laid out.

  training_batch  GRPO's rollout -> right-padded [prompt + completion] rows and where each completion token's
                  log-prob is read
  micro_batches   rows -> micro-batches for gradient accumulation: grouped by length, within --micro_batch /
                  --train_micro_batch rows and --micro_batch_tokens tokens, as many on every rank (sft.py, grpo.py)
  micro_batch     one micro-batch -> model.forward's input: padded rows, or (--pack) its sequences packed into rows,
                  each attending to itself, and (--share_prompt) a group's prompt held once
  pack_rows       first-fit decreasing: sequences -> rows of at most `width` tokens
  packed_attention  a row of packed sequences sharing prompts -> Packed, the attention segment by segment
"""

from typing import NamedTuple

import torch

from common import all_reduce_named
from model import additive_mask, sdpa


def training_batch(prompts: list[list[int]], comp: torch.Tensor, n_comp: list[int], pad_id: int):
    """Right-padded [prompt + completion] rows and where each completion token's log-prob sits, on
    comp's device.

    prompts: N token lists; comp: (N, Tc) sampled tokens; n_comp: valid completion length per row
    (EOS included). Returns inputs (N, L), targets (N, L), pos (N, Tc): the column of inputs whose
    next-token prediction is completion token t (position len(prompt) - 1 + t, clamped for padding);
    and prompt_of (host list, N): (the first row with row i's prompt, that prompt's length).
    """
    # host lists: one device -> host copy
    rows = [p + c[:n] for p, c, n in zip(prompts, comp.tolist(), n_comp)]
    L = max(len(r) for r in rows) - 1
    # -1 marks padding in targets (its log-prob is never read)
    inputs = [r[:-1] + [pad_id] * (L + 1 - len(r)) for r in rows]
    targets = [r[1:] + [-1] * (L + 1 - len(r)) for r in rows]
    device = comp.device
    t = torch.arange(comp.shape[1], device=device)
    pos = torch.tensor([len(p) - 1 for p in prompts], device=device)[:, None] + t[None, :]  # (N, Tc)
    first = {}
    prompt_of = [(first.setdefault(tuple(p), i), len(p)) for i, p in enumerate(prompts)]
    return (torch.tensor(inputs, device=device), torch.tensor(targets, device=device), pos.clamp(max=L - 1),
            prompt_of)


def micro_batches(lengths: list[int], max_rows: int, max_tokens: int = 0) -> list[list[int]]:
    """Split this rank's rows (lengths: each row's real length, host ints) into micro-batches for gradient
    accumulation: row indices, grouped by length (longest first) so that each micro-batch, padded to its longest
    row, pads little. A micro-batch holds at most max_rows rows and, if max_tokens > 0, at most max_tokens padded
    tokens (rows x its longest row); a row longer than max_tokens goes alone (0 = no limit). Inside a micro-batch
    the rows keep their order. Every rank gets as many micro-batches as the rank that needs the most (a collective:
    FSDP2's gathers and DDP's reduction must pair up), padded with empty ones."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: equal lengths keep their order
    out, cur = [], []
    for i in order:
        full_rows = max_rows > 0 and len(cur) == max_rows
        full_tokens = max_tokens > 0 and (len(cur) + 1) * lengths[cur[0] if cur else i] > max_tokens
        if cur and (full_rows or full_tokens):
            out.append(sorted(cur))
            cur = []
        cur.append(i)
    if cur:
        out.append(sorted(cur))
    n = int(all_reduce_named({"n": len(out)}, {"n": "max"})["n"])
    return out + [[] for _ in range(n - len(out))]


def micro_batch(inputs, targets, pos, prompt_of, rows: list[int], seq_len: list[int], pack: bool,
                share: bool = False) -> dict:
    """The forward's input for training rows `rows` of training_batch's (inputs, targets, pos, prompt_of):
    seq_len[i] is row i's real length. Cut to W columns, the longest of these rows. pack: the rows'
    sequences packed into as few rows of W tokens as fit (pack_rows), each attending only to
    itself (segments), its RoPE positions restarting at 0. share (with pack): the rows of one prompt
    hold it once: its tokens but the last as a segment of their own, then each row's last prompt
    token and completion attending to it and to itself, all in one row (attention runs segment by
    segment: packed_attention), where that packs fewer tokens. -> model.forward's keyword arguments:
    tokens (R, W'), targets (R, W'), target_pos (n, Tc) flat indices of the completion tokens'
    predictions (padding clamped to the sequence's last), and input_pos, segments (R, W') if packed
    (segments a Packed where prompts are shared)."""
    device, n = inputs.device, len(rows)
    W = max(seq_len[i] for i in rows)  # (rows twice as wide packed tighter, but were slower on CPU)
    ix = torch.tensor(rows, device=device)
    # units: what goes into a row whole: [(j, 0)], one sequence, or [(j0, s), (j1, s), ...]: a
    # prompt's s = len(prompt) - 1 tokens once, then each member's columns s.. (host ints)
    units = [[(j, 0)] for j in range(n)]
    width = lambda u: u[0][1] + sum(seq_len[rows[j]] - s for j, s in u)  # a unit's tokens
    bins = pack_rows([seq_len[i] for i in rows], W) if pack else []
    one_row = False  # all units in one row: attention segment by segment, whatever is shared
    if pack and share:
        shared = _shared_prompt_units(prompt_of, rows)
        if sum(map(width, shared)) < len(bins) * W:  # fewer tokens than packed whole: one row of them all
            units, bins, one_row = shared, [list(range(len(shared)))], True
    Wr = max(sum(width(units[m]) for m in b) for b in bins) if bins else W  # the rows' width
    if len(bins) in (0, n) and Wr == W:  # one sequence a row: padded rows, plain causal attention
        flat = pos[ix].clamp(max=W - 1) + W * torch.arange(n, device=device)[:, None]
        return {"tokens": inputs[ix, :W], "targets": targets[ix, :W].clamp(min=0), "target_pos": flat}
    src, seg, pre, at, start = _packed_slots(bins, units, rows, seq_len, inputs.shape[1], Wr)
    src = torch.tensor(src, device=device)
    real = src >= 0
    tokens = torch.where(real, inputs.flatten()[src.clamp(min=0)], 0)  # padding: any token
    tgt = torch.where(real, targets.flatten()[src.clamp(min=0)], 0).clamp(min=0)
    last = torch.tensor([seq_len[i] - 1 for i in rows], device=device)[:, None]  # (n, 1)
    flat = torch.tensor(start, device=device)[:, None] + torch.minimum(pos[ix], last)  # (n, Tc)
    out = {"tokens": tokens.view(-1, Wr), "targets": tgt.view(-1, Wr), "target_pos": flat,
           "input_pos": torch.tensor(at, device=device).view(-1, Wr),
           "segments": torch.tensor(seg, device=device).view(-1, Wr)}
    if one_row:  # (a dense mask over one row of them all would grow with its square)
        out["segments"] = packed_attention(out["segments"], torch.tensor(pre, device=device).view(-1, Wr))
    return out


def _shared_prompt_units(prompt_of, rows: list[int]) -> list[list[tuple[int, int]]]:
    """micro_batch's units with each prompt held once: per prompt with several rows here, [(j, s), ...]
    with s = len(prompt) - 1 shared tokens; a prompt's only row, [(j, 0)]."""
    groups = {}  # first row of the prompt -> its rows here
    for j in range(len(rows)):
        groups.setdefault(prompt_of[rows[j]][0], []).append(j)
    return [[(j, prompt_of[rows[g[0]]][1] - 1) for j in g] if len(g) > 1 else [(g[0], 0)]
            for g in groups.values()]


def _packed_slots(bins, units, rows: list[int], seq_len: list[int], L: int, Wr: int):
    """Host lists over the packed rows' slots (R * Wr): each slot's source in the flattened (N, L) inputs
    (-1: padding), its segment, its prefix (the segment it also attends to), its RoPE position; and per
    micro-batch row the flat index its column 0 would have."""
    src, seg, pre, at, start = [], [], [], [], [0] * len(rows)
    for r, members in enumerate(bins):
        c = 0
        for u in (units[m] for m in members):
            j0, s = u[0]
            prompt_seg = len(seg)  # (a segment's id: its first slot's index)
            if s:  # the shared prompt: row j0's first s columns, a segment of its own
                src += [rows[j0] * L + k for k in range(s)]
                seg += [prompt_seg] * s
                pre += [prompt_seg] * s
                at += range(s)
                c += s
            for j, _ in u:
                own = seq_len[rows[j]] - s
                start[j] = r * Wr + c - s  # the flat index its column 0 would have
                src += [rows[j] * L + k for k in range(s, s + own)]
                pre += [prompt_seg if s else len(seg)] * own
                seg += [len(seg)] * own
                at += range(s, s + own)
                c += own
        src += [-1] * (Wr - c)  # padding: pad tokens, one segment of their own
        seg += [-1] * (Wr - c)
        pre += [-1] * (Wr - c)
        at += [0] * (Wr - c)
    return src, seg, pre, at, start


def pack_rows(lengths: list[int], width: int) -> list[list[int]]:
    """First-fit decreasing: sequences (lengths, host ints, each <= width) -> rows of at most width tokens, each
    a list of sequence indices in the order they sit in the row. Longest first; ties keep their order."""
    rows, used = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = next((r for r, u in enumerate(used) if u + lengths[i] <= width), len(rows))
        if r == len(rows):
            rows.append([])
            used.append(0)
        rows[r].append(i)
        used[r] += lengths[i]
    return rows


class Packed(NamedTuple):
    """packed_attention's index maps, and the attention over them (model.forward's segments= takes it)."""

    own: torch.Tensor  # (n, L) flat positions of the segments without a prompt (padding: the last), causal
    shared: tuple | None  # segments with one: (q (m, Lq), k (m, Lk) the prompt's then their own, bias (m, 1, Lq, Lk))
    inv: torch.Tensor  # (B T,) each position's index in the two's outputs, (n L + m Lq); 0 for padding

    def attend(self, q, k, v):
        """q (B, T, H, D), k, v (B, T, Hkv, D) -> (B T, H, D): attention segment by segment, each an SDPA batch
        entry padded to its batch's longest."""
        B, T, _, D = q.shape
        seg = lambda x, at: x.reshape(B * T, -1, D).index_select(0, at.flatten()).unflatten(
            0, at.shape).transpose(1, 2)  # (B, T, h, D) -> (n, h, L, D) at (n, L) flat positions
        ys = [sdpa(seg(q, self.own), seg(k, self.own), seg(v, self.own), is_causal=True)]  # (n, H, L, D)
        if self.shared is not None:
            at, keys, bias = self.shared
            ys.append(sdpa(seg(q, at), seg(k, keys), seg(v, keys), bias.to(q.dtype)))  # (m, H, Lq, D)
        return torch.cat([y.transpose(1, 2).flatten(0, 1) for y in ys]).index_select(0, self.inv)  # (B T, H, D)


def packed_attention(segments, prompt_segments) -> Packed:
    """Attention over packed rows segment by segment instead of over whole rows (whose masked pairs grow with the
    square of the width), each segment an SDPA batch entry: segments without a prompt (the prompts themselves,
    sequences alone) causal within themselves; segments with one, their queries against its keys, then their own.
    Two batches, so a long prompt does not pad its short continuations. segments (B, T) long as model.forward's,
    a segment's id the flat index (row * T + column) of its first position, its positions contiguous, -1: padding;
    prompt_segments (B, T) long: the segment each position also attends to, a prompt that several packed sequences
    share (its own segment where none)."""
    seg, pre = segments.flatten(), prompt_segments.flatten()  # (B T,)
    device, real = seg.device, seg >= 0
    starts, lens = torch.unique(seg[real], return_counts=True)  # (S,) each, in flat order
    length = torch.zeros_like(seg).index_put_((starts,), lens)  # (B T,) each segment's length at its id
    p0 = pre[starts]  # (S,) each segment's prompt: itself where it has none
    pl = torch.where(p0 == starts, 0, length[p0])  # (S,) its prompt's length
    has = pl > 0
    n, L, Lq, Lk = torch.stack([(~has).sum(), torch.where(has, 0, lens).max(), torch.where(has, lens, 0).max(),
                                torch.where(has, lens + pl, 0).max()]).tolist()  # one host sync
    last = starts + lens - 1  # (S,)
    i, j = torch.arange(max(L, Lq), device=device), torch.arange(Lk, device=device)
    a, b = (~has).nonzero()[:, 0], has.nonzero()[:, 0]  # (n,), (m,) which segments
    own = torch.minimum(starts[a, None] + i[:L], last[a, None])  # (n, L)
    shared = None
    if len(b):
        col = j - pl[b, None]  # (m, Lk) key j's column in its segment; < 0: in the prompt
        k = torch.where(col < 0, p0[b, None] + j, torch.minimum(starts[b, None] + col, last[b, None]))  # (m, Lk)
        keep = (col[:, None, :] < 0) | (col[:, None, :] <= i[:Lq, None])  # (m, Lq, Lk): the prompt, then causal
        bias = additive_mask(keep[:, None], torch.float32)  # (the attention's dtype when it runs)
        shared = (torch.minimum(starts[b, None] + i[:Lq], last[b, None]), k, bias)
    # each segment's first output row: its group's block, then its place in the group
    rank = torch.empty_like(starts)
    rank[a], rank[b] = torch.arange(len(a), device=device) * L, n * L + torch.arange(len(b), device=device) * Lq
    flat = torch.arange(len(seg), device=device)
    u = (torch.searchsorted(starts, flat, right=True) - 1).clamp(min=0)  # (B T,) each position's segment
    return Packed(own, shared, torch.where(real, rank[u] + flat - starts[u], 0))
