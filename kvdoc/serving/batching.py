"""Rows of different lengths in one forward: prompts left-padded to one length, with a pad mask
and per-row positions (:func:`generate_padded`); or a scheduler's ragged step, each row in its
own blocks (:class:`RaggedStep`).

Left padding lines every prompt's last token up in the last column. Each row is the function
of its prompt alone (:func:`kvdoc.teach.serving_checks.compare_with_alone` checks it): slot
``t`` of row ``b`` is at **position** ``t - pad[b]``, and the **mask** lets a real query read
slots ``pad[b] .. t`` only (a pad query the pad slots before it, so no softmax row is empty).

>>> from kvdoc import Decoder, GPTConfig, generate
>>> _ = torch.manual_seed(0)
>>> model = Decoder(GPTConfig()).eval()
>>> batch = left_pad([[5, 6, 7], [8]])
>>> batch.ids.tolist(), batch.pad.tolist()
([[5, 6, 7], [0, 0, 8]], [0, 2])
>>> out = generate_padded(model, [[5, 6, 7], [8]], max_new_tokens=4)
>>> torch.equal(out.tokens[1], generate(model, torch.tensor([[8]]), 4)[0, 1:])  # as if alone
True
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvdoc.core.cache import KV, KVCache
from kvdoc.core.model import Decoder
from kvdoc.core.state import StateLayer, StateSpec

from .paged import BlockPool, PoolLayer, gather


@dataclass(frozen=True)
class PaddedBatch:
    """Prompts padded on the left: ``ids`` ``[B, L]``, row ``b`` starting with ``pad[b]`` pads."""

    ids: torch.Tensor
    pad: torch.Tensor


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> PaddedBatch:
    """Pad ``prompts`` (non-empty lists of token ids) on the left to the longest one.

    >>> left_pad([[1, 2], [3, 4, 5]], pad_id=9).ids.tolist()
    [[9, 1, 2], [3, 4, 5]]
    """
    if len(prompts) == 0:
        raise ValueError("left_pad needs at least one prompt")
    rows = [list(p) for p in prompts]
    if any(len(r) == 0 for r in rows):
        raise ValueError("every prompt needs at least one token")
    if any(isinstance(t, bool) or not isinstance(t, int) for r in rows for t in r):
        raise ValueError("prompts must be lists of integer token ids")
    width = max(len(r) for r in rows)
    pad = [width - len(r) for r in rows]
    ids = torch.tensor([[pad_id] * n + r for n, r in zip(pad, rows, strict=True)])
    return PaddedBatch(ids, torch.tensor(pad))


def padded_positions(pad: torch.Tensor, start: int, new_len: int) -> torch.Tensor:
    """``[B, C]`` positions of slots ``start .. start + C - 1``: slot minus the row's pad, at
    least 0.

    >>> padded_positions(torch.tensor([0, 2]), start=1, new_len=3).tolist()
    [[1, 2, 3], [0, 0, 1]]
    """
    slots = torch.arange(start, start + new_len, device=pad.device)
    return (slots[None, :] - pad[:, None]).clamp(min=0)


def padded_mask(pad: torch.Tensor, start: int, new_len: int) -> torch.Tensor:
    """``[B, C, start + C]`` bool: the key slots each new query slot may read.

    >>> padded_mask(torch.tensor([1]), start=0, new_len=3).int()[0]
    tensor([[1, 0, 0],
            [0, 1, 0],
            [0, 1, 1]], dtype=torch.int32)
    """
    query = torch.arange(start, start + new_len, device=pad.device)  # slots of the new queries
    key = torch.arange(start + new_len, device=pad.device)
    causal = key[None, :] <= query[:, None]  # [C, T]
    real_key = key[None, None, :] >= pad[:, None, None]  # [B, 1, T]
    real_query = query[None, :, None] >= pad[:, None, None]  # [B, C, 1]
    return causal & (real_key == real_query)


@dataclass(frozen=True)
class PaddedGeneration:
    """``tokens`` ``[B, N]`` chosen greedily for each row, and the ``logits`` ``[B, N, V]``."""

    tokens: torch.Tensor
    logits: torch.Tensor


@torch.no_grad()
def generate_padded(model: Decoder, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    pad_id: int = 0) -> PaddedGeneration:
    """Greedy generation of ``max_new_tokens`` per row for prompts of different lengths.

    >>> from kvdoc import Decoder, GPTConfig
    >>> _ = torch.manual_seed(0)
    >>> out = generate_padded(Decoder(GPTConfig()).eval(), [[1, 2, 3], [4]], 2)
    >>> tuple(out.tokens.shape), tuple(out.logits.shape)
    ((2, 2), (2, 2, 97))
    """
    batch = left_pad(prompts, pad_id)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    device = model.wte.weight.device
    ids, pad = batch.ids.to(device), batch.pad.to(device)
    if ids.shape[1] + max_new_tokens > model.config.n_positions:
        raise ValueError(f"{ids.shape[1]} slots + {max_new_tokens} new tokens exceed the model's "
                         f"{model.config.n_positions} positions")
    cache, start, chosen, logits = model.new_cache(ids.shape[0]), 0, [], []
    for _ in range(max_new_tokens):
        C = ids.shape[1]
        out, cache = model(ids, cache, last_only=True, positions=padded_positions(pad, start, C),
                           attn_mask=padded_mask(pad, start, C))
        logits.append(out[:, -1])
        ids = out[:, -1].argmax(dim=-1, keepdim=True)  # [B, 1]: the next call's input
        chosen.append(ids)
        start += C
    return PaddedGeneration(torch.cat(chosen, dim=1), torch.stack(logits, dim=1))


# --- a ragged step: each row in its own blocks ------------------------------------------------

class RaggedLayer(PoolLayer):
    """Layer ``index`` of a :class:`RaggedStep`, its real new rows in their rows' blocks."""

    def __init__(self, step: RaggedStep, index: int) -> None:
        super().__init__(step.pool, len(step.past), index)
        self.step = step

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        self.check_rows(k, v)
        s = self.step
        # the real new rows only: [M, H_kv, D_h] into (block, :, offset) of each row's blocks
        for store, new in zip(self.stores, (k, v), strict=True):
            store[s.blocks, :, s.offsets] = new[s.rows, :, s.cols]
        return self.read(start)

    def read(self, seq_len: int) -> KV:
        s = self.step
        return gather(*self.stores, s.table, s.width)


class RaggedStep:
    """One ragged step: row ``b`` holds ``past[b]`` positions in its blocks ``tables[b]`` (with
    room for its new ones) and brings ``new[b]`` tokens, right-padded to ``C = max new``; its
    K/V rows are gathered back to ``T = max (past + new)`` columns from the ``cache`` the model
    writes into. Per-row positions and a per-row mask make each row its own sequence's function
    (real engines pack the tokens instead, with variable-length kernels).

    >>> from kvdoc import Decoder
    >>> from kvdoc.core.model import llama_config
    >>> _ = torch.manual_seed(0)
    >>> model = Decoder(llama_config()).eval()          # RoPE
    >>> pool = BlockPool(model.config, num_blocks=4, block_size=4)
    >>> ids = torch.tensor([[5, 6, 7, 8, 9], [3, 1, 4, 0, 0]])  # row 1: 3 tokens, then padding
    >>> step = RaggedStep(pool, tables=[[0, 1], [2]], past=[0, 0], new=[5, 3])
    >>> logits = model(ids, step.cache, positions=step.positions(), attn_mask=step.mask()).logits
    >>> torch.allclose(logits[1, :3], model(ids[1:, :3]).logits[0], atol=1e-5)
    True
    >>> step = RaggedStep(pool, tables=[[0, 1], [2]], past=[5, 3], new=[1, 1])  # both decode
    >>> logits = model(torch.tensor([[2], [1]]), step.cache, positions=step.positions(),
    ...                attn_mask=step.mask()).logits
    >>> torch.allclose(logits[1, 0], model(torch.tensor([[3, 1, 4, 1]])).logits[0, -1], atol=1e-5)
    True

    >>> from kvdoc.core.model import GPTConfig
    >>> pool = BlockPool(GPTConfig(), num_blocks=3, block_size=4)
    >>> step = RaggedStep(pool, tables=[[0, 1], [2]], past=[5, 0], new=[1, 3])
    >>> step.seq_len, step.positions().tolist()  # T = 6 columns, C = 3 new
    (3, [[5, 0, 0], [0, 1, 2]])
    """

    def __init__(self, pool: BlockPool, tables: Sequence[list[int]], past: Sequence[int],
                 new: Sequence[int]) -> None:
        S = pool.block_size
        self.pool, self.past, self.new = pool, list(past), list(new)
        if not tables or min(self.new) < 1 or min(self.past) < 0:
            raise ValueError("a step needs rows, each with at least one new token")
        self.width = max(p + n for p, n in zip(past, new, strict=True))  # T
        if any(len(t) * S < p + n for t, p, n in zip(tables, past, new, strict=True)):
            raise ValueError("every row needs blocks for its new positions before the step")
        n_blocks = math.ceil(self.width / S)
        # a row shorter than T reads its own first block past its end; the mask hides it
        self.table = torch.tensor([t[:n_blocks] + [t[0]] * (n_blocks - len(t[:n_blocks]))
                                   for t in tables], dtype=torch.long, device=pool.device)
        rows = [(b, j) for b, n in enumerate(new) for j in range(n)]
        slots = torch.tensor([self.past[b] + j for b, j in rows], device=pool.device)
        self.rows = torch.tensor([b for b, _ in rows], device=pool.device)
        self.cols = torch.tensor([j for _, j in rows], device=pool.device)
        self.blocks = self.table[self.rows, slots // S]
        self.offsets = slots % S
        self.seq_len, self.device = self.width - max(self.new), pool.device
        # a state layer (a hybrid model's) holds its rows' states beside the pool, as a
        # paged cache's does: the scheduler sets them before a call and keeps what it returns
        self.cache = KVCache([StateLayer(len(self.past), spec, pool.dtype, pool.device)
                              if isinstance(spec, StateSpec) else RaggedLayer(self, i)
                              for i, spec in enumerate(pool.layout)], seq_len=self.seq_len)

    def _grid(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, C]``: whether column ``j`` is a real new token, and its position ``P_b + j``."""
        past, new = (torch.tensor(x, device=self.device)[:, None] for x in (self.past, self.new))
        j = torch.arange(max(self.new), device=self.device)[None, :]
        return j < new, past + j

    def mask(self) -> torch.Tensor:
        """``[B, C, T]`` bool: query ``P_b + j`` reads keys ``0 .. P_b + j``, a pad query key 0."""
        real, position = self._grid()
        key = torch.arange(self.width, device=self.device)
        return torch.where(real[..., None], key <= position[..., None], key == 0)

    def positions(self) -> torch.Tensor:
        """``[B, C]``: ``P_b + j`` for the real new tokens, 0 for the padding."""
        real, position = self._grid()
        return torch.where(real, position, 0)
