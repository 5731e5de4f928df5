"""The lean decode step that :class:`~kvdoc.core.fast.FastDecoder` is timed against; its ablation.

:class:`LeanStep` is the fast step's arithmetic and nothing else (no checks, no watch on the
weights, its own K/V buffers, GPT-2's architecture only): the time the fast step takes beyond
it is what its guarantees cost. An :data:`ABLATION` variant undoes one of the fast step's
changes, so the time it adds is what that change buys; a :data:`GUARANTEES` variant takes a
guarantee away, so the time it saves is what that guarantee costs (timed only: none may serve
a user).

>>> from kvdoc import Decoder, GPTConfig
>>> _ = torch.manual_seed(0)
>>> model = Decoder(GPTConfig(n_kv_head=2)).eval()
>>> ids = torch.tensor([[12, 7, 31, 4, 9]])
>>> lean = LeanStep(model, capacity=8)
>>> lean.start(model(ids[:, :4], model.new_cache(1, "static", capacity=8)).cache)
>>> logits = lean(ids[:, 4:])                       # [1, 1, V]: position 4
>>> torch.allclose(logits[:, 0], model(ids).logits[:, 4], atol=1e-5)
True
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

from kvdoc.core.cache import KVCache
from kvdoc.core.fast import FastDecoder
from kvdoc.core.model import Decoder, DecoderOutput

ABLATION = {"no_pretranspose": {"pretranspose": False}, "matmul_attention": {"attention": "matmul"}}
"""The lean step with one change undone: :class:`LeanStep`'s keywords per variant."""


class UnwatchedFast(FastDecoder):
    """The fast step without its watch on the model's weights: it would serve stale copies."""

    def _stale(self) -> bool:
        return False


class UncheckedFast(FastDecoder):
    """The fast step without its input checks and its hand-over to the model: every call is
    taken as one token per row after a cache, and bad input is not refused."""

    def __call__(self, idx: torch.Tensor, cache: KVCache, **options: object) -> DecoderOutput:
        if self._stale():
            self.refresh()
        return self._step(idx, cache)


class UnguardedFast(FastDecoder):
    """The fast step with neither guarantee: its arithmetic, writing through the cache's
    ``update``. What still separates it from :class:`LeanStep` is that write path."""

    def __call__(self, idx: torch.Tensor, cache: KVCache, **options: object) -> DecoderOutput:
        return self._step(idx, cache)


GUARANTEES: dict[str, type[FastDecoder]] = {"unwatched": UnwatchedFast,
                                             "unchecked": UncheckedFast,
                                             "unguarded": UnguardedFast}
"""The fast step with one guarantee taken away, or both (``unguarded``), per variant."""


class LeanStep:
    """One token per row for a GPT-2-style decoder, with nothing around the arithmetic, up to
    ``capacity`` positions. ``pretranspose``: weights stored ``[in, out]`` (else read through a
    transposed view, as ``F.linear`` does); ``attention``: ``"sdpa"`` (one call, a K/V head's
    query heads as rows) or ``"matmul"`` (matmul, scale, softmax, matmul)."""

    def __init__(self, model: Decoder, capacity: int, *, pretranspose: bool = True,
                 attention: Literal["sdpa", "matmul"] = "sdpa") -> None:
        cfg = model.config
        gpt2 = ("learned", "layernorm", "gelu", None)
        if (cfg.position, cfg.norm, cfg.mlp, cfg.sliding_window) != gpt2:
            raise ValueError("LeanStep runs GPT-2's architecture only (learned positions, "
                             "LayerNorm, GELU, no window)")
        self.config, self.capacity, self.attention = cfg, capacity, attention
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        with torch.no_grad():
            def w(linear: torch.nn.Linear) -> torch.Tensor:  # [in, out], as the step reads it
                weight = linear.weight.detach()
                return weight.t().contiguous() if pretranspose else weight.clone().t()

            def b(linear: torch.nn.Linear) -> torch.Tensor:
                return linear.bias.detach().view(1, -1).clone()

            self.layers = [
                (blk.ln_1.weight.detach(), blk.ln_1.bias.detach(), w(blk.attn.c_attn),
                 b(blk.attn.c_attn), w(blk.attn.c_proj), b(blk.attn.c_proj),
                 blk.ln_2.weight.detach(), blk.ln_2.bias.detach(), w(blk.mlp.c_fc), b(blk.mlp.c_fc),
                 w(blk.mlp.c_proj), b(blk.mlp.c_proj))
                for blk in model.h]
            self.ln_f = (model.ln_f.weight.detach(), model.ln_f.bias.detach())
            self.w_head = w(model.lm_head)  # [d, V]
            self.wte, self.wpe = model.wte.weight.detach(), model.wpe.weight.detach()
        self.pos = 0

    def start(self, cache: KVCache) -> None:
        """Take a copy of ``cache``'s K/V (the prompt) into fresh buffers; the next token is at
        ``cache.seq_len``."""
        cfg, P = self.config, cache.seq_len
        shape = (cache.batch_size, cfg.n_kv_head, self.capacity, cfg.head_dim)
        self.k = [self.wte.new_zeros(shape) for _ in self.layers]
        self.v = [self.wte.new_zeros(shape) for _ in self.layers]
        for i in range(cfg.n_layer):
            k, v = cache.layer(i)
            self.k[i][:, :, :P], self.v[i][:, :, :P] = k, v
        self.pos = P

    def rewind(self, pos: int) -> None:
        """Go back to position ``pos``: the positions after it are written again."""
        self.pos = pos

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, 1, V]`` of the tokens ``idx`` (``[B, 1]``) at position ``self.pos``."""
        cfg = self.config
        B, P, D_h = idx.shape[0], self.pos, cfg.head_dim
        shape, eps = (cfg.n_embd,), cfg.layer_norm_epsilon
        heads, group = (cfg.n_head, cfg.n_kv_head, cfg.n_kv_head), cfg.n_head // cfg.n_kv_head
        x = self.wte.index_select(0, idx.view(B)).add_(self.wpe[P])  # [B, d]
        for i, (ln1_w, ln1_b, w_qkv, b_qkv, w_o, b_o, ln2_w, ln2_b, w_fc, b_fc, w_proj,
                b_proj) in enumerate(self.layers):
            h = torch.layer_norm(x, shape, ln1_w, ln1_b, eps)
            q, k, v = torch.addmm(b_qkv, h, w_qkv).view(B, -1, 1, D_h).split_with_sizes(heads, 1)
            K, V = self.k[i], self.v[i]
            K.narrow(2, P, 1).copy_(k)
            V.narrow(2, P, 1).copy_(v)
            k, v = K.narrow(2, 0, P + 1), V.narrow(2, 0, P + 1)  # [B, H_kv, P + 1, D_h]
            if group > 1:  # a K/V head's query heads as rows: [B, H_kv, group, D_h]
                q = q.view(B, -1, group, D_h)
            if self.attention == "sdpa":
                y = F.scaled_dot_product_attention(q, k, v)
            else:
                s = torch.matmul(q, k.transpose(2, 3)).mul_(self.scale)  # [B, H_kv, group, P + 1]
                y = torch.matmul(s.softmax(-1), v)
            x = torch.addmm(x, y.view(B, -1), w_o).add_(b_o)
            h = torch.layer_norm(x, shape, ln2_w, ln2_b, eps)
            u = F.gelu(torch.addmm(b_fc, h, w_fc), approximate="tanh")
            x = torch.addmm(x, u, w_proj).add_(b_proj)
        self.pos = P + 1
        h = torch.layer_norm(x, shape, *self.ln_f, eps)
        return torch.mm(h, self.w_head).view(B, 1, -1)
