"""A GPT-2 decoder whose one forward serves both paths: full recompute and cached continuation.

Read top to bottom: the MLP, causal self-attention (where the cache is used), the block, the
decoder, then ``prefill`` / ``decode_step`` / ``generate``. Parameter names are GPT-2's
(``wte, wpe, h, ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj, ln_f, lm_head``),
so a transformers checkpoint maps by key (:mod:`kvdoc.interop.hf_weights`).

The same classes build a Llama-style decoder (:func:`kvdoc.core.config.llama_config`): the config
switches RoPE for ``wpe`` (:mod:`kvdoc.core.rope`), RMSNorm for LayerNorm, SwiGLU for GELU, and a
sliding window for the plain causal mask. The cache, the attention over it and the decoding
loop are the same code for both. Under :func:`kvdoc.batch_invariant` the library calls that reduce
take :mod:`kvdoc.core.invariant`'s path, whose order no chunk, batch or cache kind changes.

Shapes: ``B`` batch, ``C`` new tokens in this call, ``P`` positions already cached,
``T = P + C``, ``d`` = ``n_embd``, ``H`` query heads, ``H_kv`` K/V heads, ``D_h`` head size,
``V`` vocabulary. K and V are always ``[B, H_kv, T, D_h]``.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .cache import DynamicCache, KVCache, StaticCache
from .checks import check_call
from .config import GPTConfig
from .embed import embed_tokens
from .mask import last_keys, offset_causal_mask
from .rope import apply_rope
from .window import SlidingWindowCache


def norm(config: GPTConfig) -> nn.Module:
    """The normalisation of ``ln_1``, ``ln_2`` and ``ln_f``: LayerNorm (GPT-2) or RMSNorm."""
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd, eps=config.layer_norm_epsilon)  # x / rms(x) * weight
    return nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)


class MLP(nn.Module):
    """Position-wise feed-forward: ``c_proj(gelu_tanh(c_fc(x)))``; output row ``t`` needs row ``t``.

    With ``config.mlp == "swiglu"`` (Llama) ``c_fc`` is twice as wide and its two halves are the
    gate and the up projection: ``c_proj(silu(gate) * up)``.

    >>> MLP(GPTConfig())(torch.zeros(2, 5, 64)).shape  # [B, C, d] -> [B, C, d]
    torch.Size([2, 5, 64])
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.swiglu = config.mlp == "swiglu"
        width = 2 * config.n_inner if self.swiglu else config.n_inner
        self.c_fc = nn.Linear(config.n_embd, width, bias=config.bias)
        self.c_proj = nn.Linear(config.n_inner, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, d] -> [B, C, d]
        if self.swiglu:
            gate, up = self.c_fc(x).chunk(2, dim=-1)  # [B, C, n_inner] each
            return self.c_proj(F.silu(gate) * up)
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))  # GPT-2's "gelu_new"


class CausalSelfAttention(nn.Module):
    """Multi-head (or grouped-query) causal self-attention that reads and extends a K/V cache.

    ``forward(x, cache, layer_idx, start)`` takes the new rows ``x`` (``[B, C, d]``) at absolute
    positions ``start .. start + C - 1``, projects them to Q, K and V, stores K and V in layer
    ``layer_idx`` of ``cache`` and attends over every cached and new key. ``attn_mask`` is for
    left-padded batches (:mod:`kvdoc.serving.batching`); see :meth:`attend`.

    >>> from kvdoc.core.cache import DynamicCache
    >>> _ = torch.manual_seed(0)
    >>> attn = CausalSelfAttention(GPTConfig(n_kv_head=2))
    >>> work = DynamicCache.empty(GPTConfig(n_kv_head=2), batch_size=1).begin()
    >>> attn(torch.randn(1, 3, 64), work, layer_idx=0, start=0).shape
    torch.Size([1, 3, 64])
    >>> work.layer(0)[0].shape  # K: [B, H_kv, T, D_h]
    torch.Size([1, 2, 3, 16])
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.head_dim
        self.window = config.sliding_window
        self.rope_theta = config.rope_theta if config.position == "rope" else None
        # Q, K and V in one matmul (split into heads in forward)
        self.c_attn = nn.Linear(config.n_embd, config.n_embd + 2 * config.kv_dim,
                                bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor, cache: KVCache | None, layer_idx: int,
                start: int, attn_mask: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        B, C, d = x.shape
        # c_attn's output columns are H query heads, then H_kv key heads, then H_kv
        # value heads, each D_h wide: one view splits all heads at once.
        H, H_kv = self.n_head, self.n_kv_head
        heads = self.c_attn(x).view(B, C, H + 2 * H_kv, self.head_dim).transpose(1, 2)
        q, k, v = heads.split((H, H_kv, H_kv), dim=1)
        # q: [B, H, C, D_h]; k, v: [B, H_kv, C, D_h]
        if self.rope_theta is not None:  # turn the new rows before K is cached
            # at start .. start + C - 1, or at each row's own positions
            at = start if positions is None else positions
            q = apply_rope(q, at, self.rope_theta)
            k = apply_rope(k, at, self.rope_theta)
        if cache is not None:
            # Only the new rows were projected; old K/V come from this layer's cache.
            k, v = cache.update(layer_idx, k, v, start)  # [B, H_kv, P + C, D_h]
        y = self.attend(q, k, v, start, attn_mask)  # [B, H, C, D_h]
        y = y.transpose(1, 2).reshape(B, C, d)  # merge heads: [B, C, H * D_h]
        return self.c_proj(y)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``softmax(q k^T / sqrt(D_h) + mask) v`` for queries at ``start ..``: ``[B, H, C, D_h]``.

        The mask is :meth:`visible`'s. ``k`` and ``v`` (``[B, H_kv, T, D_h]``) hold the
        positions up to the last query's.
        """
        mask = self.visible(start, q.shape[2], k.shape[2], attn_mask, q.device)
        if mask is not None and mask.dim() == 3:
            mask = mask[:, None]  # [B, 1, C, T]: the same for every head
        # scores [B, H, C, T]; enable_gqa only when it is needed, as the keyword alone slows SDPA
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)

    def visible(self, start: int, C: int, T: int, attn_mask: torch.Tensor | None,
                device: torch.device) -> torch.Tensor | None:
        """Which of the ``T`` keys each of the ``C`` queries at ``start ..`` reads: ``[C, T]``,
        ``[B, C, T]`` from ``attn_mask``, or None when nothing is hidden.

        The offset causal mask of :mod:`kvdoc.core.mask` (with the model's window), unless
        ``attn_mask`` (``[B, C, P + C]`` bool, True: may read) replaces it: a left-padded batch
        (:mod:`kvdoc.serving.batching`) or a scheduler's ragged step hides what each row does
        not hold that way, and :func:`last_keys` applies the window to it. A window cache
        returns only the last ``T`` keys, in order, so the mask keeps its last ``T`` columns.
        """
        if attn_mask is not None:
            return last_keys(attn_mask[..., -T:], self.window)
        if C == 1 and self.window is None:
            return None  # one query at position P after keys 0 .. P: nothing to hide
        return offset_causal_mask(start, C, device, window=self.window)[:, -T:]


class Block(nn.Module):
    """Pre-norm decoder layer: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``.

    ``attn_mask`` goes to the attention unchanged (left-padded batches, see
    :meth:`CausalSelfAttention.visible`), and so do ``positions`` (a RoPE model's per-row
    positions).

    >>> Block(GPTConfig())(torch.zeros(1, 4, 64), None, layer_idx=0, start=0).shape
    torch.Size([1, 4, 64])
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = norm(config)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cache: KVCache | None, layer_idx: int, start: int,
                attn_mask: torch.Tensor | None = None, **positions: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, layer_idx, start, attn_mask, **positions)
        return x + self.mlp(self.ln_2(x))


class DecoderOutput(NamedTuple):
    """What :meth:`Decoder.forward` returns."""

    logits: torch.Tensor
    """``[B, C, V]`` (``[B, 1, V]`` with ``last_only``): ``logits[:, i]`` predicts the token
    after new token ``i``."""
    cache: KVCache | None
    """The cache holding positions ``0 .. P + C - 1``, or None when none was passed."""


class Decoder(nn.Module):
    """A GPT-2 decoder: embeddings, ``n_layer`` pre-norm blocks, final LayerNorm, untied LM head.

    With a Llama-style config (:func:`kvdoc.core.config.llama_config`) there is no ``wpe`` (RoPE
    turns Q and K inside the attention instead), the norms are RMSNorms and the head may be tied.

    ``forward(idx)`` recomputes every position of ``idx``. ``forward(idx, cache)`` treats
    ``idx`` as the continuation of what ``cache`` holds: it embeds and projects only the new
    tokens, at absolute positions ``P .. P + C - 1`` where ``P = cache.seq_len``, attends over
    cached + new K/V, and returns the updated cache. Both are the same function of the token
    sequence; :mod:`kvdoc.proofs.compare` proves it.

    Weights use PyTorch's default initialisation (seed with ``torch.manual_seed``) or come
    from :func:`kvdoc.interop.hf_weights.from_transformers`. The model is never trained: the site
    checks that two ways of computing one function agree, which needs no language ability.

    >>> _ = torch.manual_seed(0)
    >>> model = Decoder(GPTConfig())
    >>> model.num_parameters()
    145280
    >>> ids = torch.tensor([[12, 7, 31, 4, 9, 18]])
    >>> full = model(ids).logits                        # [1, 6, 97]
    >>> _, cache = model(ids[:, :4], DynamicCache.empty(model.config, 1))
    >>> step = model(ids[:, 4:], cache).logits          # [1, 2, 97], positions 4 and 5
    >>> torch.allclose(step, full[:, 4:], atol=1e-5)
    True
    """

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or GPTConfig()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token embeddings
        self.wpe = (nn.Embedding(config.n_positions, config.n_embd)  # learned absolute positions
                    if config.position == "learned" else None)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = norm(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.wte.weight  # one [V, d] matrix embeds and predicts

    def num_parameters(self) -> int:
        """Number of parameters (an untied LM head counts apart from ``wte``, a tied one once)."""
        return sum(p.numel() for p in self.parameters())

    def check_input(self, idx: torch.Tensor, cache: KVCache | None) -> None:
        """Raise ``ValueError`` unless ``idx`` can continue ``cache`` (called before any write)."""
        check_call(self.config, self.wte.weight, idx, cache)

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None, *,
                last_only: bool = False, positions: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None) -> DecoderOutput:
        """Logits for the ``C`` new tokens in ``idx`` (``[B, C]``), continuing ``cache`` if given.

        Args:
            idx: token ids ``[B, C]``, the tokens after the ``P`` positions ``cache`` holds.
            cache: per-layer K/V of positions ``0 .. P - 1``, or None to recompute from position 0.
                A :class:`~kvdoc.core.cache.DynamicCache` or
                :class:`~kvdoc.core.window.SlidingWindowCache` passed in is left unchanged; a
                :class:`~kvdoc.core.cache.StaticCache` is written in place.
            last_only: project only the last position to the vocabulary (what generation needs).
            positions: ``[B, C]`` (or ``[C]``) positions replacing ``P .. P + C - 1``: embedded
                by ``wpe``, or, in a RoPE model, the positions Q and the new K are turned at.
                With ``attn_mask`` it serves left-padded batches (:mod:`kvdoc.serving.batching`),
                where each row's tokens start after its padding, and a scheduler's ragged steps
                (:mod:`kvdoc.serving.ragged`), where each row continues its own length.
            attn_mask: ``[B, C, P + C]`` bool replacing the offset causal mask (True: may read);
                a left-padded batch hides each row's padding with it.

        Returns:
            ``DecoderOutput(logits, cache)``: logits ``[B, C, V]`` (``[B, 1, V]`` if ``last_only``)
            and the cache now holding ``P + C`` positions (None if none was passed).

        Raises:
            ValueError: bad ids, shapes, lengths, or a cache that does not fit this model and
                input. Nothing has been written when it is raised.
        """
        self.check_input(idx, cache)
        B, C = idx.shape
        rows = positions is None or positions.dim() == 1 or positions.shape[0] in (1, B)
        if positions is not None and (positions.shape[-1:] != (C,) or positions.dim() > 2
                                      or not rows):
            raise ValueError(f"positions must be [C] or [B, C] with (B, C) = {(B, C)}, "
                             f"got {tuple(positions.shape)}")
        # a RoPE model's attention turns at them; handed over only when given, so an attention
        # written for one start per call (five arguments) still serves every other call
        rotary = {} if positions is None or self.wpe is not None else {"positions": positions}
        start = 0 if cache is None else cache.seq_len
        work = None if cache is None else cache.begin()
        x = embed_tokens(self.wte, idx)  # [B, C, d]
        if self.wpe is not None:  # RoPE models turn Q and K instead
            if positions is None:
                positions = torch.arange(start, start + C, device=idx.device)  # [C]
            x = x + self.wpe(positions)
        for layer_idx, block in enumerate(self.h):
            x = block(x, work, layer_idx, start, attn_mask, **rotary)  # [B, C, d]
        if last_only:
            x = x[:, -1:, :]  # [B, 1, d]: only the last row feeds next-token prediction
        logits = self.lm_head(self.ln_f(x))  # [B, C, V]
        if work is not None:  # after the head: a call failing there leaves the cache as it was
            work.finish(start + C)
        return DecoderOutput(logits, work)

    def new_cache(self, batch_size: int, kind: Literal["dynamic", "static", "window"] | None = None,
                  capacity: int | None = None) -> KVCache:
        """An empty cache matching this model's config, dtype and device.

        ``kind`` defaults to ``"window"`` (:class:`~kvdoc.core.window.SlidingWindowCache`) for a
        model with a sliding window and to ``"dynamic"`` otherwise. ``capacity`` (static only)
        defaults to ``n_positions``; a window cache always holds ``config.sliding_window``
        positions.
        """
        dtype, device = self.wte.weight.dtype, self.wte.weight.device
        if kind is None:
            kind = "dynamic" if self.config.sliding_window is None else "window"
        if kind == "window":
            return SlidingWindowCache(self.config, batch_size, dtype=dtype, device=device)
        if kind == "dynamic":
            return DynamicCache.empty(self.config, batch_size, dtype, device)
        if kind == "static":
            capacity = self.config.n_positions if capacity is None else capacity
            return StaticCache(self.config, batch_size, capacity, dtype, device)
        raise ValueError(f"unknown cache kind {kind!r}; use 'dynamic', 'static' or 'window'")


@torch.no_grad()
def prefill(model: Decoder, idx: torch.Tensor, cache: KVCache | None = None) -> DecoderOutput:
    """Run the prompt ``idx`` (``[B, P]``) through the model once, filling a cache.

    Returns the last position's logits ``[B, 1, V]`` and the cache (a new dynamic one unless given).

    >>> _ = torch.manual_seed(0)
    >>> model = Decoder(GPTConfig())
    >>> logits, cache = prefill(model, torch.tensor([[5, 6, 7]]))
    >>> logits.shape, cache.seq_len
    (torch.Size([1, 1, 97]), 3)
    """
    cache = model.new_cache(idx.shape[0]) if cache is None else cache
    return model(idx, cache, last_only=True)


@torch.no_grad()
def decode_step(model: Decoder, token: torch.Tensor, cache: KVCache) -> DecoderOutput:
    """Feed exactly one new token per row (``[B]`` or ``[B, 1]``) after what ``cache`` holds.

    Returns logits ``[B, 1, V]`` for the position after it, and the cache one position longer.

    >>> _ = torch.manual_seed(0)
    >>> model = Decoder(GPTConfig())
    >>> _, cache = prefill(model, torch.tensor([[5, 6, 7]]))
    >>> logits, cache = decode_step(model, torch.tensor([8]), cache)
    >>> logits.shape, cache.seq_len
    (torch.Size([1, 1, 97]), 4)
    """
    token = token.reshape(token.shape[0], -1) if token.dim() == 1 else token
    if token.dim() != 2 or token.shape[1] != 1:
        raise ValueError(f"decode_step takes one token per row, got shape {tuple(token.shape)}")
    return model(token, cache)


@torch.no_grad()
def generate(model: Decoder, idx: torch.Tensor, max_new_tokens: int,
             cache: str | KVCache | None = None) -> torch.Tensor:
    """Greedy generation: one prefill, then ``max_new_tokens - 1`` decode steps.

    ``cache`` is a kind ``model.new_cache`` knows (None: the model's default), or an empty
    cache of any kind to fill (a paged cache, a cache of your own layers). Returns
    ``[B, P + max_new_tokens]``: the prompt followed by the chosen tokens.

    >>> _ = torch.manual_seed(0)
    >>> model = Decoder(GPTConfig())
    >>> prompt = torch.tensor([[1, 2, 3]])
    >>> out = generate(model, prompt, 5)
    >>> out.shape
    torch.Size([1, 8])
    >>> torch.equal(out, generate(model, prompt, 5, cache="static"))
    True
    """
    model.check_input(idx, None)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    total = idx.shape[1] + max_new_tokens
    if total > model.config.n_positions:
        raise ValueError(f"prompt of {idx.shape[1]} + {max_new_tokens} new tokens = {total} "
                         f"positions, model has {model.config.n_positions}")
    if not isinstance(cache, KVCache):
        cache = model.new_cache(idx.shape[0], cache, capacity=total)
    elif cache.seq_len:
        raise ValueError(f"generate() fills an empty cache; this one holds {cache.seq_len} "
                         "positions")
    logits, kv = prefill(model, idx, cache)
    out = [idx]
    for step in range(max_new_tokens):
        token = logits[:, -1].argmax(dim=-1, keepdim=True)  # [B, 1]
        out.append(token)
        if step + 1 < max_new_tokens:
            logits, kv = decode_step(model, token, kv)
    return torch.cat(out, dim=1)
