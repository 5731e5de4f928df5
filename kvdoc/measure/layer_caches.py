"""A model's sizes, in one representation: :class:`ModelCache`, one :class:`LayerCache` a
decoder layer, and a constructor for each kind of layer. Every kind is a sum of terms, each a
size times how often it is held after ``T`` positions:

=======================  =====================================  ==============================
term                     size (elements)                        held
=======================  =====================================  ==============================
K/V, latent or K = V     ``per_token``                          ``min(T, W)`` (``T``: no W)
indexer keys             ``indexer``                            ``T``, or once an entry
compressed entries       ``entry``                              ``floor(T / rate)``
unfinished block         ``buffer``, and ``overlap`` once       ``T mod rate``; ``T >= rate``
state                    ``state`` (cache dtype), ``state32``   once, whatever ``T``
=======================  =====================================  ==============================

``state32`` is in FP32 whatever the cache's dtype, as transformers 5.24.0 keeps a Gated
DeltaNet's and a Mamba-2 layer's recurrent state (tests/test_layer_caches.py counts the tensors
its caches allocate). The published models and a ``config.json`` become one in
:mod:`kvdoc.measure.model_caches`.

>>> mla_layer(512, 64).elements(1000)           # DeepSeek-V3: a latent of 576 a position
576000
>>> indexed_mla_layer(512, 64, 128).parts(10)   # DeepSeek-V3.2 adds 128 indexer keys each
{'latent': 5760, 'indexer keys': 1280}
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from .kv_bytes import check_int, element_size, fp8_scale_bytes

if TYPE_CHECKING:
    import torch


class LayerCache(NamedTuple):
    """What one layer keeps per sequence, in elements (the module's table): ``per_token``
    (``2 x H_kv x D``; MLA ``r + d_R``; K = V ``D``; a state layer 0) up to ``window``
    positions (None: all); ``kv_heads``, 0 but for a K/V layer; ``shared_kv``: the window's rows
    serve as both K and V; ``indexer`` keys a position (``rate`` 0) or a compressed entry."""

    per_token: int
    window: int | None = None
    state: int = 0
    kv_heads: int = 0
    state32: int = 0
    indexer: int = 0
    rate: int = 0
    entry: int = 0
    buffer: int = 0
    overlap: int = 0
    shared_kv: bool = False

    @property
    def head_dim(self) -> int:
        """``D`` of a K/V layer (``per_token = 2 x H_kv x D``)."""
        return self.per_token // (2 * self.kv_heads)

    @property
    def what(self) -> str:
        """What a position's row is: ``"K/V"``, ``"latent"``, ``"K = V"`` or ``""`` (none)."""
        if not self.per_token:
            return ""
        return "K/V" if self.kv_heads else "K = V" if self.shared_kv else "latent"

    def parts(self, seq_len: int, windows: bool = True) -> dict[str, int]:
        """Elements of each nonzero term after ``seq_len`` positions (``windows=False``: no cap)."""
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
        """Elements in the cache's dtype after ``seq_len`` positions (all but ``state32``)."""
        return sum(n for name, n in self.parts(seq_len, windows).items()
                   if name != "state (FP32)")


def attention_layer(kv_heads: int, head_dim: int, window: int | None = None) -> LayerCache:
    """A K/V layer: ``2 x H_kv x D`` elements a position, capped at ``window`` if given."""
    return LayerCache(2 * check_int("kv_heads", kv_heads) * check_int("head_dim", head_dim),
                      None if window is None else check_int("window", window),
                      kv_heads=kv_heads)


def mla_layer(kv_lora_rank: int, qk_rope_head_dim: int) -> LayerCache:
    """An MLA layer: a latent of ``kv_lora_rank + qk_rope_head_dim`` a position."""
    return LayerCache(check_int("kv_lora_rank", kv_lora_rank)
                      + check_int("qk_rope_head_dim", qk_rope_head_dim))


def indexed_mla_layer(kv_lora_rank: int, qk_rope_head_dim: int,
                      index_head_dim: int) -> LayerCache:
    """A DeepSeek-V3.2 layer: MLA's latent and an indexer key of ``index_head_dim`` a position."""
    return mla_layer(kv_lora_rank, qk_rope_head_dim)._replace(
        indexer=check_int("index_head_dim", index_head_dim))


def gated_delta_layer(num_key_heads: int, num_value_heads: int, key_head_dim: int,
                      value_head_dim: int, conv_kernel: int) -> LayerCache:
    """A Gated DeltaNet layer, as transformers 5.24.0's cache holds it: a conv state ``[2 x H_k x
    D_k + H_v x D_v, kernel]`` and a recurrent state ``[H_v, D_k, D_v]`` (FP32)."""
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

def every_nth_full(layers: int, pattern: int, other: str = "sliding_attention") -> list[str]:
    """Layer types where every ``pattern``-th layer is full and the rest ``other``, as
    :func:`kvdoc.core.frame.every_nth_full` gives them (that module imports torch).

    >>> every_nth_full(4, 2)
    ['sliding_attention', 'full_attention', 'sliding_attention', 'full_attention']
    """
    check_int("layers", layers)
    check_int("pattern", pattern)
    return ["full_attention" if (i + 1) % pattern == 0 else other for i in range(layers)]


KINDS = ("plain", "windowed", "hybrid", "MLA", "linear-hybrid", "compressed")
"""The kinds of :attr:`ModelCache.kind` (hybrid: window and full layers; linear-hybrid: state
layers beside attention ones; compressed: DeepSeek-V4's)."""


@dataclass(frozen=True)
class ModelCache:
    """A model's sizes: one :class:`LayerCache` per decoder layer, the context, the ``source``
    and a ``note`` of what the count leaves out; ``heads`` (query heads), ``hidden``,
    ``intermediate`` and ``vocab`` are None where not recorded."""

    name: str
    layers: tuple[LayerCache, ...]
    max_positions: int
    source: str
    note: str = ""
    heads: int | None = None
    hidden: int | None = None
    intermediate: int | None = None
    vocab: int | None = None

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError(f"{self.name}: need at least one layer")
        check_int("max_positions", self.max_positions)
        if self.heads is not None and self.heads % self.kv_heads:
            raise ValueError(f"{self.name}: heads={self.heads} is not divisible by "
                             f"kv_heads={self.kv_heads}")

    @property
    def kind(self) -> str:
        """One of :data:`KINDS`, read off the layers."""
        whats = {layer.what for layer in self.layers}
        if "K = V" in whats:
            return "compressed"
        if "latent" in whats:
            return "MLA"
        if "" in whats:
            return "linear-hybrid"
        full = {layer.window is None for layer in self.layers}
        return "hybrid" if len(full) == 2 else "plain" if full == {True} else "windowed"

    def _kv_layer(self) -> LayerCache:
        for layer in self.layers:
            if layer.kv_heads:
                return layer
        raise ValueError(f"{self.name} has no K/V attention layer")

    @property
    def kv_heads(self) -> int:
        """``H_kv`` of the (first) K/V layer."""
        return self._kv_layer().kv_heads

    @property
    def head_dim(self) -> int:
        """``D`` of the (first) K/V layer."""
        return self._kv_layer().head_dim

    @property
    def sliding_window(self) -> int | None:
        """``W`` of the windowed layers (None: no layer is windowed)."""
        return next((layer.window for layer in self.layers if layer.window), None)

    @property
    def attention(self) -> str:
        """``"MHA"``, ``"GQA"`` or ``"MQA"`` (``H_kv == H``, between, ``1``)."""
        if self.kv_heads == self.heads:
            return "MHA"
        return "MQA" if self.kv_heads == 1 else "GQA"

    def parts(self, seq_len: int, batch: int = 1, dtype: str | torch.dtype = "float16",
              windows: bool = True) -> dict[str, int]:
        """Bytes of ``batch`` sequences of ``seq_len`` positions by term (FP32 state: 4 bytes).

        >>> from kvdoc.measure.model_caches import model_cache
        >>> model_cache("Qwen3-Next-80B-A3B").parts(0, dtype="bfloat16")  # T = 0: the states
        {'state': 2359296, 'state (FP32)': 75497472}
        """
        b, total = check_int("batch", batch), {}
        for layer in self.layers:
            for name, n in layer.parts(seq_len, windows).items():
                total[name] = total.get(name, 0) + n
        s = element_size(dtype)
        return {name: b * n * (4 if name == "state (FP32)" else s)
                for name, n in total.items()}

    def all_attention(self) -> ModelCache:
        """As many layers, each full attention of the sizes of the first layer that keeps
        positions: the cache without windows, states, indexers or compression.

        >>> from kvdoc.measure.model_caches import model_cache
        >>> model_cache("Qwen3-Next-80B-A3B").all_attention().kind
        'plain'
        """
        base = next((layer for layer in self.layers if layer.per_token), None)
        if base is None:
            raise ValueError(f"{self.name} has no layer that keeps positions")
        full = LayerCache(base.per_token, kv_heads=base.kv_heads, shared_kv=base.shared_kv)
        return ModelCache(f"{self.name}, all attention", (full,) * len(self.layers),
                          self.max_positions, self.source)

    def kv_bytes(self, seq_len: int, batch: int = 1, dtype: str | torch.dtype = "float16",
                 windows: bool = True) -> int:
        """Bytes of ``batch`` sequences of ``seq_len`` positions (``windows=False``: no cap).

        >>> from kvdoc.measure.model_caches import model_cache
        >>> oss = model_cache("gpt-oss-20b")     # past W = 128 only its 12 full layers grow
        >>> oss.kv_bytes(256) - oss.kv_bytes(128) == 12 * (2 * 8 * 64) * 2 * 128
        True
        >>> g = model_cache("Gemma-3-1B")        # 4 global layers of 26 hold all T
        >>> g.kv_bytes(32768, windows=False) // g.kv_bytes(32768)
        5
        """
        return sum(self.parts(seq_len, batch, dtype, windows).values())

    def bytes_per_token(self, dtype: str | torch.dtype = "float16",
                        past_windows: bool = False) -> int:
        """Bytes one position adds while it is inside every window (batch 1); with
        ``past_windows``, once it is past them all, when only the full layers grow. A
        compressed entry, added once a block, is not in it.

        >>> from kvdoc.measure.model_caches import model_cache
        >>> g = model_cache("Gemma-3-27B")     # 62 layers grow, then only the 10 full ones
        >>> g.bytes_per_token("bfloat16"), g.bytes_per_token("bfloat16", past_windows=True)
        (507904, 81920)
        """
        return element_size(dtype) * sum(
            (layer.per_token if not (past_windows and layer.window) else 0)
            + (0 if layer.rate else layer.indexer) for layer in self.layers)

    def fixed_bytes(self, dtype: str | torch.dtype = "float16") -> int:
        """Bytes a sequence holds whatever its length (the states; a recurrent one in FP32)."""
        return sum(self.parts(0, 1, dtype).values())

    def sequences_that_fit(self, memory: int, seq_len: int,
                           dtype: str | torch.dtype = "float16") -> int:
        """How many sequences of ``seq_len`` fit in ``memory`` bytes of cache.

        >>> from kvdoc.measure.model_caches import model_cache
        >>> model_cache("Llama-3-8B").sequences_that_fit(2**30, 8192)  # 1 GiB, 1 GiB each
        1
        """
        per_sequence = self.kv_bytes(seq_len, 1, dtype)
        if per_sequence == 0:
            raise ValueError("an empty cache: every count of sequences fits")
        return check_int("memory", memory) // per_sequence

    def fp8_scale_bytes(self, granularity: str) -> int:
        """Bytes of an FP8 cache's FP32 scales (:func:`~kvdoc.measure.kv_bytes.fp8_scale_bytes`),
        whatever ``T`` and the batch; a ValueError for a latent (scaled otherwise by engines).

        >>> from kvdoc.measure.model_caches import model_cache
        >>> model_cache("Llama-3-8B").fp8_scale_bytes("per-head")   # 32 x 2 x 8 x 4
        2048
        """
        if self.kind in ("MLA", "compressed"):
            raise ValueError(f"{self.name} caches no K/V heads ({self.kind}): its FP8 scales "
                             "are not the per-tensor or per-head K/V scales counted here")
        heads = [layer.kv_heads for layer in self.layers if layer.kv_heads]
        return fp8_scale_bytes(heads, granularity) if heads else 0

    @property
    def parameters(self) -> int | None:
        """Weights of a Llama-family model (untied head, no biases) from its sizes: embedding,
        head, final norm, and per layer Q, K, V, O, the gated MLP and two norms; else None.

        >>> from kvdoc.measure.model_caches import model_cache
        >>> model_cache("Llama-3.1-8B").parameters
        8030261248
        """
        if None in (self.hidden, self.intermediate, self.vocab):
            return None
        attention = 2 * (self.heads + self.kv_heads) * self.head_dim * self.hidden
        layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return 2 * self.vocab * self.hidden + self.hidden + len(self.layers) * layer

    def groups(self) -> list[tuple[LayerCache, int]]:
        """The distinct layers and how many of each, in order of first appearance."""
        return list(Counter(self.layers).items())
