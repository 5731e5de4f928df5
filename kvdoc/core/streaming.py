"""StreamingLLM: the first few tokens kept beside a window, keys re-rotated to where they sit.

StreamingLLM (Xiao et al., 2023) keeps the K/V of the first ``sinks`` tokens (attention sinks:
softmax puts weight on them whatever they say) and of the last ``window`` tokens, and drops
the rest. RoPE is applied *after* the cache: keys are stored before rotation and turned at their
index in the cache (sinks at ``0 .. sinks - 1``, the window after them), the query at the index
it will take, so the distances a query sees never exceed ``sinks + window``.

**This is a different function from the model's.** Once the stream passes
``sinks + window`` tokens, a query reads fewer keys than full attention does and at other
relative positions, so its logits are not the full forward's; nothing here is checked equal to
it past that point. It is *measured* against it
(:func:`kvdoc.measure.divergence.stream_divergence`); before the first eviction every
position is where it was, and there the two agree to rounding.
It is not gpt-oss's sink (:mod:`kvdoc.core.gptoss`), a learned logit in the denominator with no
token behind it.

Fed one token at a time (:func:`stream_logits`), query ``t`` reads ``min(t + 1, sinks + window)``
keys.

>>> from kvdoc.core.model import llama_config
>>> _ = torch.manual_seed(0)
>>> model = Decoder(llama_config()).eval()
>>> streaming = streaming_decoder(model, sinks=2, window=4)
>>> ids = torch.tensor([[5, 3, 8, 1, 9, 2, 7, 4]])
>>> logits, cache = stream_logits(streaming, ids)
>>> cache.held(0)                                   # 2 sinks and the last 4 positions
(0, 1, 4, 5, 6, 7)
>>> full = model(ids).logits
>>> torch.allclose(logits[:, :6], full[:, :6], atol=1e-5)   # nothing evicted before position 6
True
>>> torch.allclose(logits[:, 6:], full[:, 6:], atol=1e-5)   # a different function after it
False
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .cache import KV, CacheLayer, DynamicLayer, KVCache, check_int, offset_causal_mask
from .model import CausalSelfAttention, Decoder, GPTConfig, apply_rope


class SinkWindowLayer(CacheLayer):
    """The first ``sinks`` and the last ``window`` rows of a layer, K stored before RoPE.

    >>> layer = SinkWindowLayer.empty(1, 1, (1, 1), sinks=1, window=2)
    >>> rows = torch.arange(5.0).view(1, 1, 5, 1)
    >>> k, _ = layer.write(rows, rows, start=0)          # the call reads all 5
    >>> k.flatten().tolist(), layer.k.flatten().tolist(), layer.held(5)
    ([0.0, 1.0, 2.0, 3.0, 4.0], [0.0, 3.0, 4.0], (0, 3, 4))
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, sinks: int, window: int) -> None:
        super().__init__(k.shape[0], k.shape[1], (k.shape[3], v.shape[3]), k.dtype, k.device)
        self.sinks, self.window = check_int("sinks", sinks, minimum=0), check_int("window", window)
        self.k, self.v = k, v

    @classmethod
    def empty(cls, batch_size: int, heads: int, widths: tuple[int, int], sinks: int, window: int,
              dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> SinkWindowLayer:
        empty = DynamicLayer.empty(batch_size, heads, widths, dtype, device)
        return cls(empty.k, empty.v, sinks, window)

    def held(self, seq_len: int) -> tuple[int, ...]:  # not a range: a gap after the sinks
        s = min(self.sinks, seq_len)
        return (*range(s), *range(max(s, seq_len - self.window), seq_len))

    def read(self, seq_len: int) -> KV:
        return self.k, self.v

    def _keep(self, rows: torch.Tensor, last: int) -> torch.Tensor:  # the sinks, the last rows
        T = rows.shape[2]
        if T <= self.sinks + last:
            return rows
        return torch.cat((rows[:, :, :self.sinks], rows[:, :, T - last:]), dim=2)

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        # a new query reads the sinks and the W - 1 rows before it (its window holds itself)
        self.check_rows(k, v)
        full_k = torch.cat((self._keep(self.k, self.window - 1), k), dim=2)
        full_v = torch.cat((self._keep(self.v, self.window - 1), v), dim=2)
        self.k, self.v = self._keep(full_k, self.window), self._keep(full_v, self.window)
        return full_k, full_v

    def expected_nbytes(self, seq_len: int) -> int:
        return self.row_bytes(len(self.held(seq_len)))


def sink_window_cache(config: GPTConfig, batch_size: int, sinks: int,
                      dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu") -> KVCache:
    """An empty cache of :class:`SinkWindowLayer` s for a streaming model's ``config`` (its
    ``sliding_window`` is the window)."""
    return KVCache([SinkWindowLayer.empty(batch_size, s.heads, s.widths, sinks, s.window, dtype,
                                          device) for s in config.cache_layout])


class StreamingAttention(CausalSelfAttention):
    """:class:`~kvdoc.core.model.CausalSelfAttention` whose RoPE turns after the cache: keys at
    their index among the rows read, queries at the last ``C`` of those indices."""

    def forward(self, x: torch.Tensor, cache: KVCache | None, layer_idx: int, start: int,
                attn_mask: torch.Tensor | None = None, **positions: torch.Tensor) -> torch.Tensor:
        if cache is None or attn_mask is not None or positions.get("positions") is not None:
            raise ValueError("a StreamingLLM model runs over its sink-and-window cache, with "
                             "neither a mask nor positions of its own")
        B, C, _ = x.shape
        H, H_kv = self.n_head, self.n_kv_head
        heads = self.c_attn(x).view(B, C, H + 2 * H_kv, self.head_dim).transpose(1, 2)
        q, k, v = heads.split((H, H_kv, H_kv), dim=1)
        k, v = cache.update(layer_idx, k, v, start)  # unrotated, every row this call reads
        T = k.shape[2]
        q, k = apply_rope(q, T - C, self.rope_theta), apply_rope(k, 0, self.rope_theta)
        mask = None if C == 1 else offset_causal_mask(T - C, C, x.device)
        gqa = {"enable_gqa": True} if H_kv != H else {}
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)
        return self.c_proj(y.transpose(1, 2).reshape(B, C, -1))


class StreamingDecoder(Decoder):
    """A decoder of :class:`StreamingAttention`; its default cache keeps ``sinks`` tokens."""

    def __init__(self, config: GPTConfig, sinks: int) -> None:
        super().__init__(config)
        self.sinks = check_int("sinks", sinks, minimum=0)
        for block in self.h:
            block.attn = StreamingAttention(config)

    def new_cache(self, batch_size: int, kind: str | None = None,
                  capacity: int | None = None) -> KVCache:
        if kind not in (None, "sink-window"):
            raise ValueError(f"a StreamingLLM model takes its sink-and-window cache, not {kind!r}")
        weight = self.wte.weight
        return sink_window_cache(self.config, batch_size, self.sinks, weight.dtype,
                                 weight.device)


def streaming_decoder(model: Decoder, sinks: int, window: int) -> StreamingDecoder:
    """A copy of the RoPE ``model`` (weights, dtype, device) that keeps ``sinks`` first tokens
    and a window of ``window``, its keys re-rotated to their cache positions."""
    config = model.config
    if not isinstance(config, GPTConfig) or config.position != "rope" or config.sliding_window:
        raise ValueError("StreamingLLM re-rotates keys: it needs a RoPE Decoder without a window")
    weight = model.wte.weight
    with torch.random.fork_rng():
        clone = StreamingDecoder(dataclasses.replace(config, sliding_window=window), sinks)
    clone.load_state_dict(model.state_dict())
    return clone.to(weight.dtype).to(weight.device).eval()


@torch.no_grad()
def stream_logits(model: StreamingDecoder, ids: torch.Tensor) -> tuple[torch.Tensor, KVCache]:
    """Feed ``ids`` (``[B, T]``) one token a call: the logits ``[B, T, V]`` and the cache."""
    cache, out = model.new_cache(ids.shape[0]), []
    for t in range(ids.shape[1]):
        logits, cache = model(ids[:, t:t + 1], cache)
        out.append(logits)
    return torch.cat(out, dim=1), cache
