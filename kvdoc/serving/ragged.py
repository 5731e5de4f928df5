"""A ragged step: one forward over rows of different lengths, each row in its own blocks.

Row ``b`` holds ``P_b`` cached positions and brings ``n_b`` new tokens, right-padded to ``C =
max n_b``; it writes its K/V rows into its own blocks and reads them back, gathered to ``T =
max (P_b + n_b)`` columns. Per-row positions and a per-row mask (query ``P_b + j`` reads keys
``0 .. P_b + j``; a pad query key 0) make each row the function of its own sequence. Real
engines pack the tokens instead, with variable-length kernels: padding costs time, not
correctness.

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
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvdoc.core.cache import KV, KVCache
from kvdoc.core.state import StateLayer, StateSpec

from .paged import BlockPool, PoolLayer, gather


class RaggedLayer(PoolLayer):
    """Layer ``index`` of a :class:`RaggedStep`: the real new rows go into their rows' blocks,
    and a read gathers every row's ``T`` columns (the mask hides what a row does not hold)."""

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
    """One ragged step: row ``b``'s blocks ``tables[b]`` (with room for its new positions),
    ``past[b]`` positions held, ``new[b]`` new tokens; the model writes into ``cache``.

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

    def mask(self) -> torch.Tensor:
        """``[B, C, T]`` bool: a real query at position ``P_b + j`` reads keys ``0 .. P_b + j``
        of its row; a pad query reads key 0 only."""
        C = max(self.new)
        past = torch.tensor(self.past, device=self.device)[:, None, None]
        new = torch.tensor(self.new, device=self.device)[:, None, None]
        j = torch.arange(C, device=self.device)[None, :, None]
        key = torch.arange(self.width, device=self.device)[None, None, :]
        return torch.where(j < new, key <= past + j, key == 0)

    def positions(self) -> torch.Tensor:
        """``[B, C]``: ``P_b + j`` for the real new tokens, 0 for the padding."""
        C = max(self.new)
        past = torch.tensor(self.past, device=self.device)[:, None]
        new = torch.tensor(self.new, device=self.device)[:, None]
        j = torch.arange(C, device=self.device)[None, :]
        return torch.where(j < new, past + j, 0)
