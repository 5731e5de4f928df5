"""What one decoder layer keeps per sequence: :class:`LayerCache`, and a constructor for each
kind of layer the memory command counts.

Every kind is a sum of terms, each a size times how often it is held after ``T`` positions:

=======================  =====================================  ==============================
term                     size (elements)                        held
=======================  =====================================  ==============================
K/V, latent or K = V     ``per_token``                          ``min(T, W)`` (``T``: no W)
indexer keys             ``indexer``                            ``T``, or once an entry
compressed entries       ``entry``                              ``floor(T / rate)``
unfinished block         ``buffer``, and ``overlap`` once       ``T mod rate``; ``T >= rate``
state                    ``state`` (cache dtype), ``state32``   once, whatever ``T``
=======================  =====================================  ==============================

``state32`` is counted in FP32 whatever the cache's element type: transformers 5.24.0 keeps a
Gated DeltaNet's and a Mamba-2 layer's recurrent state in float32 beside a bfloat16 model (its
conv state in the model's dtype); tests/test_layer_caches.py counts the tensors its cache classes
allocate and compares them with :meth:`LayerCache.elements`. Importing this module does not
import torch.

>>> mla_layer(512, 64).elements(1000)           # DeepSeek-V3: a latent of 576 a position
576000
>>> indexed_mla_layer(512, 64, 128).parts(10)   # DeepSeek-V3.2 adds 128 indexer keys each
{'latent': 5760, 'indexer keys': 1280}
"""

from __future__ import annotations

from typing import NamedTuple

from .kv_bytes import check_int


class LayerCache(NamedTuple):
    """What one layer keeps per sequence, in elements (the module's table)."""

    per_token: int
    """Elements one more position adds (``2 x H_kv x D``; MLA: ``r + d_R``; K = V: ``D``;
    a state layer: 0)."""
    window: int | None = None
    """``W``: the layer keeps at most the last ``W`` positions (None: all of them)."""
    state: int = 0
    """Elements held whatever the length, in the cache's dtype (a conv state)."""
    kv_heads: int = 0
    """``H_kv`` of a K/V layer (per-head FP8 scales count it); 0 for the other kinds."""
    state32: int = 0
    """Elements held whatever the length, in FP32 (a recurrent state)."""
    indexer: int = 0
    """Indexer-key elements of every position (``rate`` 0) or of every compressed entry."""
    rate: int = 0
    """Positions a compressed entry stands for (0: no compression)."""
    entry: int = 0
    """Elements of one compressed entry."""
    buffer: int = 0
    """Elements each position of the unfinished block keeps until its entry is written."""
    overlap: int = 0
    """Elements carried from the last finished block into the next entry."""
    shared_kv: bool = False
    """The window's rows serve as both K and V (one copy)."""

    @property
    def what(self) -> str:
        """What a position's row is: ``"K/V"``, ``"latent"``, ``"K = V"`` or ``""`` (none)."""
        if not self.per_token:
            return ""
        return "K/V" if self.kv_heads else "K = V" if self.shared_kv else "latent"

    def parts(self, seq_len: int, windows: bool = True) -> dict[str, int]:
        """Elements of each term after ``seq_len`` positions, the nonzero ones, by name
        (``windows=False``: the window caps nothing)."""
        T = check_int("seq_len", seq_len, minimum=0)
        reach = T if self.window is None or not windows else min(T, self.window)
        entries = T // self.rate if self.rate else 0
        parts = {self.what: self.per_token * reach,
                 "indexer keys": self.indexer * (entries if self.rate else T),
                 "compressed entries": self.entry * entries,
                 "block buffer": (self.buffer * (T % self.rate)
                                  + self.overlap * (T >= self.rate)) if self.rate else 0,
                 "state": self.state, "state (FP32)": self.state32}
        return {name: n for name, n in parts.items() if n}

    def elements(self, seq_len: int, windows: bool = True) -> int:
        """Elements in the cache's dtype after ``seq_len`` positions (all terms but
        ``state32``)."""
        return sum(n for name, n in self.parts(seq_len, windows).items()
                   if name != "state (FP32)")


def attention_layer(kv_heads: int, head_dim: int, window: int | None = None) -> LayerCache:
    """A K/V layer: ``2 x H_kv x D`` elements a position, capped at ``window`` if given."""
    return LayerCache(2 * check_int("kv_heads", kv_heads) * check_int("head_dim", head_dim),
                      None if window is None else check_int("window", window),
                      kv_heads=kv_heads)


def mla_layer(kv_lora_rank: int, qk_rope_head_dim: int) -> LayerCache:
    """An MLA layer: one latent of ``kv_lora_rank`` plus the rotary key of
    ``qk_rope_head_dim``, a position (no separate K and V)."""
    return LayerCache(check_int("kv_lora_rank", kv_lora_rank)
                      + check_int("qk_rope_head_dim", qk_rope_head_dim))


def indexed_mla_layer(kv_lora_rank: int, qk_rope_head_dim: int,
                      index_head_dim: int) -> LayerCache:
    """A DeepSeek-V3.2 layer: MLA's latent and one indexer key of ``index_head_dim`` a
    position, every position kept (the top-k a query reads changes with the query)."""
    return mla_layer(kv_lora_rank, qk_rope_head_dim)._replace(
        indexer=check_int("index_head_dim", index_head_dim))


def gated_delta_layer(num_key_heads: int, num_value_heads: int, key_head_dim: int,
                      value_head_dim: int, conv_kernel: int) -> LayerCache:
    """A Gated DeltaNet layer (Qwen3-Next, Qwen3.5), as transformers 5.24.0's cache holds it:
    a conv state ``[conv_dim, kernel]`` with ``conv_dim = 2 x H_k x D_k + H_v x D_v`` and a
    recurrent state ``[H_v, D_k, D_v]`` (FP32); nothing per position."""
    for name, value in (("num_key_heads", num_key_heads), ("num_value_heads", num_value_heads),
                        ("key_head_dim", key_head_dim), ("value_head_dim", value_head_dim),
                        ("conv_kernel", conv_kernel)):
        check_int(name, value)
    conv_dim = 2 * num_key_heads * key_head_dim + num_value_heads * value_head_dim
    return LayerCache(0, state=conv_dim * conv_kernel,
                      state32=num_value_heads * key_head_dim * value_head_dim)


def mamba2_layer(heads: int, head_dim: int, groups: int, d_state: int,
                 conv_kernel: int) -> LayerCache:
    """A Mamba-2 layer (Bamba, Granite 4, Nemotron-H), as transformers 5.24.0's cache holds
    it: a conv state ``[conv_dim, kernel]`` with ``conv_dim = H x P + 2 x G x N`` (the inner
    width, then B and C of every group) and an SSM state ``[H, P, N]`` (FP32).

    >>> mamba2_layer(128, 64, 1, 128, 4).state32     # Bamba-9B: 128 x 64 x 128
    1048576
    """
    for name, value in (("heads", heads), ("head_dim", head_dim), ("groups", groups),
                        ("d_state", d_state), ("conv_kernel", conv_kernel)):
        check_int(name, value)
    conv_dim = heads * head_dim + 2 * groups * d_state
    return LayerCache(0, state=conv_dim * conv_kernel, state32=heads * head_dim * d_state)


def compressed_layer(head_dim: int, window: int, rate: int = 0,
                     index_head_dim: int = 0) -> LayerCache:
    """A DeepSeek-V4 layer, as transformers 5.24.0's caches hold it: a window of ``window``
    rows of one ``head_dim`` head serving as K and V; with ``rate``, one compressed entry of
    ``head_dim`` a block of ``rate`` positions, and the unfinished block's projected K/V and
    gate rows. With ``index_head_dim`` (a CSA layer) the compressor projects two series
    (``2 x head_dim``), carries the last block's first series (``overlap``), and an indexer
    keeps its own entries of ``index_head_dim`` the same way; without, an HCA layer.

    >>> csa = compressed_layer(512, 128, 4, 128)     # DeepSeek-V4's CSA layers
    >>> csa.parts(1001)['compressed entries'], csa.parts(1001)['indexer keys']
    (128000, 32000)
    """
    layer = LayerCache(check_int("head_dim", head_dim), check_int("window", window),
                       shared_kv=True)
    if not rate:
        return layer
    check_int("rate", rate)
    if not index_head_dim:  # HCA: kv and gate of head_dim a buffered position
        return layer._replace(rate=rate, entry=head_dim, buffer=2 * head_dim)
    # CSA: kv and gate of 2 x head_dim (compressor) and of 2 x index_head_dim (indexer) a
    # buffered position; the carried kv and gate slices, rate rows of each width
    check_int("index_head_dim", index_head_dim)
    return layer._replace(rate=rate, entry=head_dim, indexer=index_head_dim,
                          buffer=4 * (head_dim + index_head_dim),
                          overlap=2 * rate * (head_dim + index_head_dim))
