"""A paged K/V cache: fixed-size blocks from one pool, a block table per sequence, a free list.

vLLM's PagedAttention layout (Kwon et al., 2023), written for reading: a :class:`BlockPool`
owns each layer's two stores ``[num_blocks, heads, block_size, width]`` (a block id names the
same slot in every store), and a :class:`PagedCache` keeps position ``t`` of sequence ``b`` at
offset ``t % block_size`` of block ``tables[b][t // block_size]``, gathering the blocks back into
``[B, H_kv, T, D_h]`` for the model. Every position is kept; the model's mask limits what a
windowed layer reads. Blocks are reference-counted: :meth:`PagedCache.fork` shares them, a write
into a shared block copies it first (copy-on-write), and a block nobody holds goes back on the
free list (a cache releases its blocks when collected or on :meth:`PagedCache.release`).

>>> from kvdoc import Decoder, GPTConfig
>>> _ = torch.manual_seed(0)
>>> model = Decoder(GPTConfig()).eval()
>>> ids = torch.tensor([[12, 7, 31, 4, 9, 18]])
>>> cache = new_paged_cache(model, batch=1, capacity=8, block_size=4)
>>> _, cache = model(ids[:, :5], cache)
>>> cache.tables, cache.pool.num_free
([[0, 1]], 0)
>>> step = model(ids[:, 5:], cache).logits
>>> torch.allclose(step, model(ids).logits[:, 5:], atol=1e-5)
True
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

import torch

from kvdoc.core.cache import KV, CacheLayer, HasLayout, KVCache, check_int
from kvdoc.core.indexed import IndexedLayer
from kvdoc.core.model import Decoder
from kvdoc.core.state import StateLayer, StateSpec


class BlockPool:
    """K/V storage cut into ``num_blocks`` blocks of ``block_size`` positions, with a free list:
    ``k[l]`` and ``v[l]`` are layer ``l``'s two stores, as ``config.cache_layout[l]`` says.

    >>> from kvdoc import GPTConfig
    >>> pool = BlockPool(GPTConfig(), num_blocks=3, block_size=4)
    >>> pool.allocate(2), pool.num_free
    ([0, 1], 1)
    >>> pool.allocate(2)
    Traceback (most recent call last):
    ...
    ValueError: out of blocks: 2 needed, 1 free of 3
    """

    def __init__(self, config: HasLayout, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        check_int("num_blocks", num_blocks)
        check_int("block_size", block_size)
        self.layout = config.cache_layout
        # [N, H, S, width]: K and V of H_kv heads, or c_KV and k_rope of one head; a recurrent
        # layer's state is no rows (0 heads): its stores are empty, its state is the cache's
        self.k, self.v = ([torch.zeros((num_blocks, s.heads, block_size,
                                        s.widths[i] if s.heads else 0), dtype=dtype,
                                       device=device) for s in self.layout]
                          for i in (0, 1))
        # an indexed model's indexer keys (DeepSeek-V3.2, two parts a layer) in the same blocks
        index = getattr(config, "index_widths", None)
        self.index_k, self.index_v = ([] if index is None else [
            torch.zeros((num_blocks, 1, block_size, index[i]), dtype=dtype, device=device)
            for _ in self.layout] for i in (0, 1))
        self.config, self.num_blocks, self.block_size = config, num_blocks, block_size
        self.dtype, self.device = dtype, torch.device(device)
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 is handed out first
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        """Blocks on the free list."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - len(self._free)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block: both stores (K and V) of every layer, indexer keys too."""
        return sum(store[0].numel() * store.element_size() for store in self.stores())

    def stores(self) -> tuple[torch.Tensor, ...]:
        """Every store of the pool: K and V of every layer, then any indexer keys."""
        return (*self.k, *self.v, *self.index_k, *self.index_v)

    def refs(self, block: int) -> int:
        """How many sequences hold ``block``."""
        return self._refs[block]

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks off the free list, each held once (a ValueError if too few)."""
        if n > len(self._free):
            raise ValueError(f"out of blocks: {n} needed, "
                             f"{len(self._free)} free of {self.num_blocks}")
        ids = [self._free.pop() for _ in range(n)]
        for i in ids:
            self._refs[i] = 1
        return ids

    def share(self, ids: Sequence[int]) -> None:
        """One more holder for each block of ``ids``."""
        for i in ids:
            self._refs[i] += 1

    def release(self, ids: Sequence[int]) -> None:
        """One holder fewer for each block of ``ids`` (none: back on the free list)."""
        for i in ids:
            self._refs[i] -= 1
            if self._refs[i] == 0:
                self._free.append(i)

    def to_write(self, table: list[int], start: int, end: int) -> int:
        """Blocks to copy or allocate before ``table`` takes positions ``start .. end - 1``."""
        first, last = start // self.block_size, math.ceil(end / self.block_size)
        return max(0, last - len(table)) + sum(self._refs[b] > 1 for b in table[first:last])

    def own(self, table: list[int], start: int, end: int) -> None:
        """Own every block positions ``start .. end - 1`` fall in: copy shared, allocate missing."""
        first, last = start // self.block_size, math.ceil(end / self.block_size)
        for n in range(first, min(last, len(table))):
            if self._refs[table[n]] > 1:
                table[n] = self.copy(table[n])
        table.extend(self.allocate(max(0, last - len(table))))

    def copy(self, block: int) -> int:
        """Copy-on-write: a fresh block with ``block``'s contents, held instead of it."""
        (new,) = self.allocate(1)
        for store in self.stores():
            store[new] = store[block]
        self.release([block])
        return new

    def nbytes(self) -> int:
        """Bytes of the whole pool (every block, free or not)."""
        return self.num_blocks * self.block_nbytes


class BlockTables:
    """The block table of each of ``batch_size`` sequences, shared by a cache's layers."""

    def __init__(self, pool: BlockPool, batch_size: int) -> None:
        self.pool, self.block_size = pool, pool.block_size
        self.rows: list[list[int]] = [[] for _ in range(check_int("batch_size", batch_size))]

    def needed(self, start: int, end: int) -> int:
        """Blocks to allocate or copy so every sequence can write positions ``start .. end - 1``."""
        return sum(self.pool.to_write(table, start, end) for table in self.rows)

    def reserve(self, start: int, end: int) -> None:
        """Own every block positions ``start .. end - 1`` fall in (done by a call's first layer)."""
        needed = self.needed(start, end)
        if needed > self.pool.num_free:  # check first: a refused write changes nothing
            raise ValueError(f"out of blocks: positions {start}..{end - 1} need {needed} more "
                             f"blocks, {self.pool.num_free} free of {self.pool.num_blocks}")
        for table in self.rows:
            self.pool.own(table, start, end)

    def tensor(self, end: int) -> torch.Tensor:
        """``[B, blocks]``: the blocks that hold positions ``0 .. end - 1``."""
        n = math.ceil(end / self.block_size)
        return torch.tensor([t[:n] for t in self.rows], dtype=torch.long, device=self.pool.device)


def _release_tables(pool: BlockPool, tables: list[list[int]]) -> None:
    for table in tables:
        pool.release(table)
        table.clear()


class PoolLayer(CacheLayer):
    """Layer ``index`` of sequences whose rows live in ``pool``'s blocks, written in place."""

    in_place = True

    def __init__(self, pool: BlockPool, batch_size: int, index: int,
                 keys: bool = False) -> None:
        spec = pool.layout[index]
        heads, widths = (1, pool.config.index_widths) if keys else (spec.heads, spec.widths)
        super().__init__(batch_size, heads, widths, pool.dtype, pool.device)
        self.pool, self.index = pool, index
        # ``keys``: the layer's indexer keys, not its rows
        self.stores = ((pool.index_k[index], pool.index_v[index]) if keys
                       else (pool.k[index], pool.v[index]))

    def tensors(self) -> list[torch.Tensor]:
        """This layer's storage in the pool, which every cache of the pool shares."""
        return list(self.stores)

    def expected_nbytes(self, seq_len: int) -> int:
        # this layer's share of the pool, every block free or held
        return self.row_bytes(self.pool.num_blocks * self.pool.block_size) // self.batch_size


class PagedLayer(PoolLayer):
    """A pool layer read and written through the sequences' block tables."""

    def __init__(self, tables: BlockTables, index: int, keys: bool = False) -> None:
        super().__init__(tables.pool, len(tables.rows), index, keys)
        self.tables = tables

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        self.check_rows(k, v)
        end = start + k.shape[2]
        self.tables.reserve(start, end)
        size = self.tables.block_size
        slots = torch.arange(start, end, device=self.device)
        blocks, offsets = self.tables.tensor(end)[:, slots // size], slots % size  # [B, C], [C]
        # Indexing [N, H_kv, S, D_h] by ([B, C], :, [C]) addresses [B, C, H_kv, D_h].
        for store, new in zip(self.stores, (k, v), strict=True):
            store[blocks, :, offsets] = new.transpose(1, 2)
        return self.read(end)

    def read(self, seq_len: int) -> KV:
        """K and V of positions ``0 .. seq_len - 1`` of every sequence, ``[B, H_kv, T, D_h]``."""
        return gather(*self.stores, self.tables.tensor(seq_len), seq_len)


def gather(k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, length: int) -> KV:
    """The first ``length`` positions of each row's blocks ``table`` from stores ``k``, ``v``."""
    B, n = table.shape
    out = []
    for store in (k, v):
        blocks = store[table]  # [B, n, H, S, width]
        _, H, S, width = store.shape
        out.append(blocks.transpose(1, 2).reshape(B, H, n * S, width)[:, :, :length])
    return out[0], out[1]


class PagedCache(KVCache):
    """``batch_size`` sequences whose K/V live in blocks of a shared :class:`BlockPool`, written
    in place; with ``shared``, every call forks the cache first, so a prefix can be continued
    several ways.

    >>> from kvdoc import Decoder, GPTConfig
    >>> _ = torch.manual_seed(0)
    >>> model = Decoder(GPTConfig()).eval()
    >>> prefix = new_shared_prefix_cache(model, batch=1, capacity=16, block_size=4)
    >>> _, prefix = model(torch.tensor([[1, 2, 3, 4, 5, 6]]), prefix)  # blocks 0 (full), 1 (half)
    >>> _, a = model(torch.tensor([[7]]), prefix)
    >>> _, b = model(torch.tensor([[8]]), prefix)
    >>> prefix.tables, a.tables, b.tables  # block 0 shared by all three; block 1 copied by each
    ([[0, 1]], [[0, 2]], [[0, 3]])
    """

    def __init__(self, pool: BlockPool, batch_size: int, shared: bool = False,
                 block_tables: type[BlockTables] = BlockTables) -> None:
        self._tables = block_tables(pool, batch_size)
        super().__init__([self._new_layer(spec, i) for i, spec in enumerate(pool.layout)])
        self.pool, self.block_size = pool, pool.block_size
        self.shared, self.block_tables = shared, block_tables
        self.tables = self._tables.rows
        # on the tables, not the cache: a call's working copy (begin) shares them
        self._finalizer = weakref.finalize(self._tables, _release_tables, pool, self.tables)

    def _new_layer(self, spec: object, i: int) -> CacheLayer:
        pool, tables = self._tables.pool, self._tables
        if isinstance(spec, StateSpec):
            return StateLayer(len(tables.rows), spec, pool.dtype, pool.device)
        if pool.index_k:  # the latent's rows and the indexer's keys, in the same blocks
            return IndexedLayer(PagedLayer(tables, i), PagedLayer(tables, i, keys=True))
        return PagedLayer(tables, i)

    def release(self) -> None:
        """Give every block back (the cache is then empty)."""
        self._finalizer()
        self._len = 0

    def fork(self, rows: Sequence[int] | None = None) -> PagedCache:
        """A cache whose sequence ``i`` shares every block of ``rows[i]`` (default: all)."""
        rows = list(range(self.batch_size)) if rows is None else list(rows)
        if not rows or any(not 0 <= r < self.batch_size for r in rows):
            raise ValueError(f"fork rows must be indices 0..{self.batch_size - 1}, got {rows}")
        child = type(self)(self.pool, len(rows), self.shared, self.block_tables)
        for table, r in zip(child.tables, rows, strict=True):
            table.extend(self.tables[r])
            self.pool.share(table)
        child.layers = [mine.restored({n: t[rows] for n, t in mine.state.items()})
                        if isinstance(mine, StateLayer) else theirs
                        for mine, theirs in zip(self.layers, child.layers, strict=True)]
        child._len = self._len
        return child

    def crop(self, length: int) -> PagedCache:
        """Forget every position from ``length`` on, in place, giving back the blocks past it."""
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self._len:
            raise ValueError(f"cannot crop a cache of {self._len} positions to {length!r}")
        for layer in self.layers:  # a state refuses to go back: before any block is released
            if isinstance(layer, StateLayer):
                layer.crop(length, self._len)
        keep = math.ceil(length / self.block_size)
        for table in self.tables:
            self.pool.release(table[keep:])
            del table[keep:]
        self._len = length
        return self

    def check_room(self, new_len: int) -> None:
        work = self.fork() if self.shared else self  # what the call will write into
        try:  # a shared cache's fork holds every block shared: its first write copies one
            needed = work._tables.needed(self._len, self._len + new_len)
        finally:
            if work is not self:
                work.release()
        if needed > self.pool.num_free:
            raise ValueError(f"out of blocks: {new_len} more positions need {needed} more blocks, "
                             f"{self.pool.num_free} free of {self.pool.num_blocks}")

    def begin(self) -> PagedCache:
        # rows are written in place; a state layer is replaced in a copy (KVCache.begin), so a
        # call that fails midway leaves the caller's state as it was
        return self.fork() if self.shared else super().begin()

    def blocks_held(self) -> int:
        """Distinct blocks this cache's sequences hold (a block shared between them counts once)."""
        return len({b for t in self.tables for b in t})

    def tensors(self) -> list[torch.Tensor]:
        """The pool's storage, shared by every cache of the pool, and its own states."""
        return [*self.pool.stores(),
                *(t for la in self.layers if isinstance(la, StateLayer) for t in la.tensors())]


def paged_cache(pool: BlockPool, batch: int, shared: bool = False) -> PagedCache:
    """An empty paged cache of ``batch`` sequences over ``pool`` (forking at every call if
    ``shared``).

    >>> from kvdoc.core.mla import MLAConfig
    >>> cache = paged_cache(BlockPool(MLAConfig(), num_blocks=2, block_size=4), batch=1)
    >>> [tuple(t.shape) for t in cache.layers[0].tensors()]     # c_KV and k_rope of layer 0
    [(2, 1, 4, 32), (2, 1, 4, 8)]
    """
    return PagedCache(pool, batch, shared)


def pool_for(model: Decoder, batch: int, capacity: int, block_size: int, spare: int,
             pool_cls: type[BlockPool] = BlockPool) -> BlockPool:
    """A pool of ``batch`` sequences' blocks of ``capacity`` positions, ``spare`` more each."""
    weight = model.wte.weight
    blocks = batch * (math.ceil(capacity / block_size) + spare)
    return pool_cls(model.config, blocks, block_size, weight.dtype, weight.device)


def new_paged_cache(model: Decoder, batch: int, capacity: int, block_size: int = 4) -> PagedCache:
    """A :class:`PagedCache` in a pool of exactly the blocks ``batch x capacity`` needs."""
    return paged_cache(pool_for(model, batch, capacity, block_size, spare=0), batch)


def new_shared_prefix_cache(model: Decoder, batch: int, capacity: int,
                            block_size: int = 4) -> PagedCache:
    """A shared-prefix :class:`PagedCache`, a spare block a sequence for a fork's copy."""
    return paged_cache(pool_for(model, batch, capacity, block_size, spare=1), batch,
                       shared=True)
