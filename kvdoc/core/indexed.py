"""Indexed sparse attention (DeepSeek-V3.2's DSA): MLA whose queries read only the top k keys.

Each layer is MLA (:mod:`kvdoc.core.mla`) plus a *lightning indexer*: a query at position ``i``
scores every key ``j <= i`` with a small key of its own, ``index_head_dim`` values cached per
position beside the latent, and attends to the ``index_topk`` best-scored positions of the
latent cache (all of them while ``i < index_topk``). The score, with ``H_I`` indexer heads::

    I(i, j) = sum_h  w_h(x_i) * H_I**-0.5 * relu(q_h(i) . k(j) * index_head_dim**-0.5)

``q_h(i)`` is ``wq_b`` of the query's own latent (``q_a_layernorm(q_a_proj(x_i))``), ``k(j)``
is ``k_norm(wk(x_j))`` (a LayerNorm with a bias), ``w(x_i)`` is ``weights_proj(x_i)``; the first
``qk_rope_head_dim`` features of each are turned by RoPE (half-split pairs, as kvdoc's own).

**Ties.** The ReLU makes ties common: a key every indexer head scores below zero scores exactly
0, and several such keys can straddle the k-th place. kvdoc breaks ties by one rule, *the
earlier position wins* (a stable sort of the scores, :func:`select`), so which keys row ``i``
reads depends on rows ``0 .. i`` only: the cached path (prefill, chunks, one-token steps) is the
full forward's function, and row ``i`` never depends on a later token.

**transformers 5.24.0 departs there**: ``DeepseekV32Indexer.forward`` ranks each row with
``torch.topk``, whose order among tied values depends on the row's length, so its cached and
full paths pick other keys where tied scores straddle the k-th place
(:doc:`/part6/2-sparse` measures it; :func:`kvdoc.interop.hf_deepseek_v32.earliest_ties` runs it
with kvdoc's rule). It also scores in float32 in an FP64 model. A near-tie (two scores within
rounding of each other, from matmuls of other shapes on the two paths) is the one thing no rule
fixes; on continuous weights it is a rounding-sized chance, where an exact tie is not.

**Cache.** A layer's cache is an :class:`IndexedLayer`: the latent's layer (``c_KV``,
``k_rope``, as MLA's) composed with a layer of the same kind holding the indexer keys, stored
as their rotary and plain parts (``[B, 1, T, qk_rope_head_dim]`` and ``[B, 1, T, index_head_dim
- qk_rope_head_dim]``). Both grow by the same positions in every call: ``kv_lora_rank +
qk_rope_head_dim + index_head_dim`` values a position and layer (:meth:`IndexedConfig.
bytes_per_position`). Nothing can be dropped: each query picks its own keys from all of them.

>>> _ = torch.manual_seed(0)
>>> model = IndexedDecoder(IndexedConfig()).eval()
>>> ids = torch.tensor([[12, 7, 31, 4, 9, 18, 40, 2, 77, 5, 61, 3]])
>>> full = model(ids).logits
>>> _, cache = model(ids[:, :9], model.new_cache(1))
>>> [tuple(t.shape) for t in cache.layer(0)], tuple(cache.layers[0].read_keys(9).shape)
([(1, 1, 9, 32), (1, 1, 9, 8)], (1, 1, 9, 16))
>>> torch.allclose(model(ids[:, 9:], cache).logits, full[:, 9:], atol=1e-5)
True
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .cache import (
    CacheLayer,
    DynamicLayer,
    KVCache,
    StaticLayer,
    check_int,
    offset_causal_mask,
)
from .frame import partial_rope
from .mla import LatentAttention, MLAConfig, MLADecoder

INDEX_NORM_EPS = 1e-6
"""Epsilon of the indexer key's LayerNorm (transformers' ``DeepseekV32Indexer.k_norm``)."""


@dataclass(frozen=True)
class IndexedConfig(MLAConfig):
    """Sizes of an indexed decoder: :class:`~kvdoc.core.mla.MLAConfig`'s, a query latent
    (``q_lora_rank``, which the indexer reads), and the indexer's.

    Args:
        index_n_heads: ``H_I``, indexer heads (their scores are summed, weighted per query).
        index_head_dim: width of an indexer query head and of the one cached indexer key;
            its first ``qk_rope_head_dim`` features are rotary.
        index_topk: ``k``, the keys each query reads (all of them while fewer exist).

    >>> IndexedConfig().bytes_per_position(torch.float32)   # (32 + 8 + 16) x 4 x 2 layers
    448
    >>> IndexedConfig(q_lora_rank=None)
    Traceback (most recent call last):
    ...
    ValueError: the indexer reads the query's latent: q_lora_rank must be set, got None
    """

    q_lora_rank: int | None = 24
    index_n_heads: int = 4
    index_head_dim: int = 16
    index_topk: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.q_lora_rank is None:
            raise ValueError("the indexer reads the query's latent: q_lora_rank must be set, "
                             "got None")
        for name in ("index_n_heads", "index_head_dim", "index_topk"):
            check_int(name, getattr(self, name))
        if self.index_head_dim <= self.qk_rope_head_dim:
            raise ValueError(f"index_head_dim={self.index_head_dim} must exceed "
                             f"qk_rope_head_dim={self.qk_rope_head_dim}: an indexer key is a "
                             "rotary part and a plain part, cached as two tensors")

    @property
    def index_widths(self) -> tuple[int, int]:
        """The indexer key's rotary and plain widths: the two tensors its cache layer holds."""
        return self.qk_rope_head_dim, self.index_head_dim - self.qk_rope_head_dim

    def bytes_per_position(self, dtype: torch.dtype) -> int:
        """Cache bytes per position and sequence, every layer: latent, rotary key, indexer key."""
        size = torch.empty((), dtype=dtype).element_size()
        return self.n_layer * (self.latent_dim + self.index_head_dim) * size


# --- the selection ---------------------------------------------------------------------------

def select(scores: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """Which keys each query reads: bool ``[B, C, T]``, the ``k`` best ``scores`` (``[B, C, T]``)
    among the ``allowed`` keys (``[C, T]`` or ``[B, C, T]``; all of them if fewer), ties to the
    earlier position. A stable sort keeps tied keys in position order, and the disallowed keys
    (``-inf``) sort after every allowed one, so the row's length does not change the choice.

    >>> s = torch.tensor([[[2., 0., 0., 0., 1., 0.]]])       # ties at 0 for the third place
    >>> select(s, torch.ones(1, 6, dtype=torch.bool), 3).int()
    tensor([[[1, 1, 0, 0, 1, 0]]], dtype=torch.int32)
    >>> select(s[..., :5], torch.ones(1, 5, dtype=torch.bool), 3).int()  # the same first keys
    tensor([[[1, 1, 0, 0, 1]]], dtype=torch.int32)
    """
    ranked = scores.masked_fill(~allowed, float("-inf")).sort(dim=-1, descending=True,
                                                               stable=True).indices
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, ranked[..., :k], True)
    return chosen & allowed  # where fewer than k are allowed, k - (allowed) picks were -inf


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_h w_h H_I**-0.5 relu(q_h . k / sqrt(D_I))`` of queries ``q`` ``[B, H_I, C, D_I]``,
    ``keys`` ``[B, 1, T, D_I]`` and head weights ``[B, C, H_I]``: ``[B, C, T]`` (V3.2's indexer
    over positions, V4's over entries)."""
    per_head = F.relu(q @ keys.mT * q.shape[-1] ** -0.5)  # [B, H_I, C, T]
    weights = weights * weights.shape[-1] ** -0.5
    # + 0.0 turns a -0.0 (a negative weight times a zero) into the 0.0 it ties with
    return (weights.transpose(1, 2)[..., None] * per_head).sum(dim=1) + 0.0


class Indexer(nn.Module):
    """The lightning indexer of one layer (weights named as transformers' ``DeepseekV32Indexer``):
    ``wq_b`` (query latent -> ``H_I`` heads), ``wk`` and ``k_norm`` (the one key), and
    ``weights_proj`` (each head's weight per query).

    >>> idx = Indexer(IndexedConfig())
    >>> k = idx.keys(torch.zeros(2, 3, 64), 0)
    >>> tuple(k.shape), tuple(idx.scores(torch.zeros(2, 3, 64), torch.zeros(2, 3, 24), k, 0).shape)
    ((2, 1, 3, 16), (2, 3, 3))
    """

    def __init__(self, config: IndexedConfig) -> None:
        super().__init__()
        self.config = c = config
        self.wq_b = nn.Linear(c.q_lora_rank, c.index_n_heads * c.index_head_dim, bias=False)
        self.wk = nn.Linear(c.n_embd, c.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(c.index_head_dim, eps=INDEX_NORM_EPS)
        self.weights_proj = nn.Linear(c.n_embd, c.index_n_heads, bias=False)

    def _rotate(self, x: torch.Tensor, at: int | torch.Tensor) -> torch.Tensor:
        return partial_rope(x, at, self.config.rope_theta, self.config.qk_rope_head_dim)

    def keys(self, x: torch.Tensor, at: int | torch.Tensor) -> torch.Tensor:
        """The new rows' indexer keys ``[B, 1, C, index_head_dim]``, turned as cached."""
        return self._rotate(self.k_norm(self.wk(x))[:, None], at)

    def scores(self, x: torch.Tensor, q_latent: torch.Tensor, keys: torch.Tensor,
               at: int | torch.Tensor) -> torch.Tensor:
        """``I(i, j)`` of the module docstring for the new rows against ``keys``
        (``[B, 1, T, index_head_dim]``): ``[B, C, T]``."""
        c = self.config
        B, C, _ = x.shape
        q = self.wq_b(q_latent).view(B, C, c.index_n_heads, c.index_head_dim).transpose(1, 2)
        return index_scores(self._rotate(q, at), keys, self.weights_proj(x))


class IndexedAttention(LatentAttention):
    """:class:`~kvdoc.core.mla.LatentAttention` reading only the keys its :class:`Indexer`
    selects; the indexer keys are written beside the latent in the layer's cache."""

    def __init__(self, config: IndexedConfig) -> None:
        super().__init__(config)
        self.indexer = Indexer(config)

    def read_mask(self, x: torch.Tensor, q_latent: torch.Tensor | None, cache: KVCache | None,
                  layer_idx: int, start: int, at: int | torch.Tensor, T: int,
                  attn_mask: torch.Tensor | None) -> torch.Tensor:
        keys = self.indexer.keys(x, at)
        if cache is not None:
            keys = index_layer(cache, layer_idx).write_keys(keys, start)  # [B, 1, T, D_I]
        allowed = (offset_causal_mask(start, x.shape[1], x.device) if attn_mask is None
                   else attn_mask[..., -T:])
        scores = self.indexer.scores(x, q_latent, keys, at)
        return self.choose(scores, allowed)[:, None]  # [B, 1, C, T]: every head alike

    def choose(self, scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """The keys read (:func:`select`); a variant changes the rule here."""
        return select(scores, allowed, self.config.index_topk)


# --- the cache -------------------------------------------------------------------------------

class IndexedLayer(CacheLayer):
    """One layer's latent (``latent``, any :class:`~kvdoc.core.cache.CacheLayer`) and indexer
    keys (``keys``, a layer of the same kind): reads and writes of ``(c_KV, k_rope)`` go to the
    first, :meth:`write_keys` to the second, so the two hold the same positions.

    >>> layer = IndexedLayer(DynamicLayer.empty(1, 1, (4, 2)), DynamicLayer.empty(1, 1, (2, 3)))
    >>> tuple(layer.write_keys(torch.ones(1, 1, 3, 5), 0).shape), layer.nbytes()
    ((1, 1, 3, 5), 60)
    """

    def __init__(self, latent: CacheLayer, keys: CacheLayer) -> None:
        if latent.in_place != keys.in_place or latent.capacity != keys.capacity:
            raise ValueError("the latent's and the indexer keys' layers must be of one kind")
        super().__init__(latent.batch_size, latent.heads, latent.widths, latent.dtype,
                         latent.device)
        self.latent, self.keys = latent, keys
        self.in_place, self.capacity = latent.in_place, latent.capacity

    def read(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.latent.read(seq_len)

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor,
                                                                           torch.Tensor]:
        return self.latent.write(k, v, start)

    def write_keys(self, keys: torch.Tensor, start: int) -> torch.Tensor:
        """Store new indexer keys ``[B, 1, C, D_I]`` at ``start ..``; returns all ``[B, 1, T, D_I]``
        (the same positions the latent holds once its own write is done)."""
        rot, plain = self.keys.write(*keys.split(self.keys.widths, dim=-1), start)
        return torch.cat((rot, plain), dim=-1)

    def read_keys(self, seq_len: int) -> torch.Tensor:
        """The indexer keys of the positions :meth:`held`: ``[B, 1, T, D_I]``."""
        return torch.cat(self.keys.read(seq_len), dim=-1)

    def held(self, seq_len: int) -> range:
        return self.latent.held(seq_len)

    def fork(self) -> IndexedLayer:
        if self.in_place:
            return self
        forked = copy.copy(self)
        forked.latent, forked.keys = self.latent.fork(), self.keys.fork()
        return forked

    def crop(self, length: int, seq_len: int) -> IndexedLayer:
        return IndexedLayer(self.latent.crop(length, seq_len), self.keys.crop(length, seq_len))

    def tensors(self) -> list[torch.Tensor]:
        return self.latent.tensors() + self.keys.tensors()

    def expected_nbytes(self, seq_len: int) -> int:
        return self.latent.expected_nbytes(seq_len) + self.keys.expected_nbytes(seq_len)

    def shape_problems(self, seq_len: int) -> list[str]:
        """What disagrees between the indexer keys and the latent after ``seq_len`` positions."""
        keys, (c_kv, _) = self.read_keys(seq_len), self.read(seq_len)
        if keys.shape[:3] != c_kv.shape[:3]:
            return [f"indexer keys {tuple(keys.shape)} beside a latent {tuple(c_kv.shape)}"]
        return []


def index_layer(cache: KVCache, layer_idx: int) -> IndexedLayer:
    """Layer ``layer_idx`` of ``cache``, refused by name unless it holds indexer keys."""
    layer = cache.layers[layer_idx]
    if not isinstance(layer, IndexedLayer):
        raise ValueError(f"layer {layer_idx} of the cache is a {type(layer).__name__}, which "
                         "holds no indexer keys: build the cache with model.new_cache")
    return layer


def indexed_cache(config: IndexedConfig, batch_size: int, kind: str = "dynamic",
                  capacity: int | None = None, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> KVCache:
    """An empty cache of :class:`IndexedLayer` s: both parts ``"dynamic"`` or ``"static"``."""
    def part(widths: tuple[int, int]) -> CacheLayer:
        if kind == "dynamic":
            return DynamicLayer.empty(batch_size, 1, widths, dtype, device)
        return StaticLayer(batch_size, 1, widths, capacity or config.n_positions, dtype, device)

    if kind not in ("dynamic", "static"):
        raise ValueError(f"an indexed model's cache is 'dynamic' or 'static', got {kind!r}")
    return KVCache([IndexedLayer(part(spec.widths), part(config.index_widths))
                    for spec in config.cache_layout])


class IndexedDecoder(MLADecoder):
    """An :class:`~kvdoc.core.mla.MLADecoder` of :class:`IndexedAttention` blocks.

    >>> IndexedDecoder(IndexedConfig()).num_parameters()
    96880
    """

    attention = IndexedAttention

    def __init__(self, config: IndexedConfig | None = None) -> None:
        super().__init__(config or IndexedConfig())

    def check_input(self, idx: torch.Tensor, cache: KVCache | None,
                    positions: torch.Tensor | None = None) -> None:
        super().check_input(idx, cache, positions)
        if cache is not None:
            for i in range(cache.n_layer):
                if index_layer(cache, i).keys.widths != self.config.index_widths:
                    raise ValueError(f"layer {i}'s indexer keys are {cache.layers[i].keys.widths}"
                                     f" wide, the model's {self.config.index_widths}")

    def new_cache(self, batch_size: int, kind: Literal["dynamic", "static"] | None = None,
                  capacity: int | None = None) -> KVCache:
        """An empty :func:`indexed_cache` for this model's dtype and device."""
        weight = self.wte.weight
        return indexed_cache(self.config, batch_size, kind or "dynamic", capacity,
                             weight.dtype, weight.device)
