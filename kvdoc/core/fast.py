"""A fast decode step, written the way serving engines write it, for the same function as the model.

:class:`FastDecoder` wraps a :class:`~kvdoc.core.model.Decoder` and is a drop-in for its cached
call: ``logits, cache = fast(idx, cache)`` takes and returns the same shapes, refuses the same
bad input with the same messages, and reads and writes the same
:class:`~kvdoc.core.cache.KVCache` objects (K and V ``[B, H_kv, T, D_h]``). A call of one new
token per row after a cache runs the fast step; every other call (a prompt, a chunk of several
tokens, no cache, per-row positions or a mask for a padded batch) goes to the model itself,
since only single-token decode is worth a second implementation.

The fast step does what the reference model leaves out for clarity:

* weights are copied once, pre-transposed to ``[in, out]``, so every projection is one
  ``torch.addmm`` on 2-D activations ``[B, d]``, not an ``nn.Linear`` module call (a one-row
  product then streams each matrix in the order it is stored);
* Q, K and V are views of the one ``c_attn`` output, split in one call;
* attention is one ``scaled_dot_product_attention`` call without a mask (the one new token
  reads every cached position), with the query heads that share a K/V head as the rows of one
  query matrix, so grouped-query and multi-query attention need no copies of K and V.

It serves every configuration the model does: GPT-2 (learned positions, LayerNorm, GELU) and
Llama-style (RoPE at position ``P``, RMSNorm, SwiGLU, no biases, a sliding window).

It is for inference: its logits carry no autograd graph (the model's own calls, which it
delegates to, do). Its copies cost a second set of weight matrices in memory. On every call it
checks that the model's modules and parameters are the objects it took (``model.lm_head.weight =
model.wte.weight`` replaces one) and that each copied matrix keeps its storage (``.to(dtype)``)
and version counter (an optimizer step, ``load_state_dict``), and copies them again if not; norms,
biases and embeddings are read from the parameters themselves. An in-place edit through
``param.data`` (``p.data.mul_(2)``) bypasses version counters: call :meth:`FastDecoder.refresh`.

:mod:`kvdoc.proofs.compare` and ``tests/test_fast.py`` prove it computes the model's function.
"""

from __future__ import annotations

from operator import attrgetter, getitem, is_
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

from . import invariant
from .cache import KVCache
from .model import Decoder, DecoderOutput, GPTConfig, apply_rope, embed_tokens

_VERSION = attrgetter("_version")
_DATA_PTR = torch.Tensor.data_ptr


class _Layer(NamedTuple):
    """One block's weights: matrices copied ``[in, out]`` and contiguous, the rest the model's."""

    ln_1: tuple[torch.Tensor, ...]  # (weight, bias) of a LayerNorm, (weight,) of an RMSNorm
    w_qkv: torch.Tensor  # [d, d + 2 kv_dim]: Q, K, V columns
    b_qkv: torch.Tensor  # [out]; zeros for a model without biases: addmm takes one either way
    w_o: torch.Tensor  # [d, d]
    b_o: torch.Tensor | None  # None without a bias: it is a separate add to the residual
    ln_2: tuple[torch.Tensor, ...]
    w_fc: torch.Tensor  # [d, n_inner] ([d, 2 n_inner] for SwiGLU: gate, then up)
    b_fc: torch.Tensor  # zeros without biases
    w_proj: torch.Tensor  # [n_inner, d]
    b_proj: torch.Tensor | None


class FastDecoder:
    """A single-token decode path over a :class:`~kvdoc.core.model.Decoder`'s weights and caches.

    Args:
        model: the decoder whose function this computes; it stays the source of truth.

    >>> from kvdoc import Decoder, GPTConfig
    >>> _ = torch.manual_seed(0)
    >>> model = Decoder(GPTConfig(n_kv_head=2)).eval()
    >>> fast = FastDecoder(model)
    >>> ids = torch.tensor([[12, 7, 31, 4, 9]])
    >>> _, cache = fast(ids[:, :4], model.new_cache(1, "static", capacity=8))  # delegated
    >>> logits, cache = fast(ids[:, 4:], cache)                                # the fast step
    >>> logits.shape, cache.seq_len
    (torch.Size([1, 1, 97]), 5)
    >>> torch.allclose(logits[:, 0], model(ids).logits[:, 4], atol=1e-5)
    True
    """

    def __init__(self, model: Decoder) -> None:
        if not isinstance(model, Decoder):
            raise ValueError(f"FastDecoder wraps a kvdoc Decoder, got {type(model).__name__}")
        if not isinstance(model.config, GPTConfig):  # MLA's and Gemma's blocks are others
            raise ValueError("FastDecoder runs the GPT-2 and Llama-style blocks of a GPTConfig; "
                             f"got {type(model).__name__} (config {type(model.config).__name__})")
        if model.config.qk_norm:  # the fused step below has no place for them
            raise ValueError("FastDecoder has no q/k norms (Qwen3); run the model itself")
        if any(p.is_inference() for p in model.parameters()):
            raise ValueError("the model's parameters were created under torch.inference_mode() and "
                             "have no version counters, so FastDecoder could not see them change; "
                             "build the model outside inference mode")
        self.model = model
        self.config = model.config
        self.refresh()

    def refresh(self) -> None:
        """Copy the model's weight matrices again (done automatically when they change)."""
        m, cfg = self.model, self.model.config
        # what _stale compares (the module docstring says why): every module and parameter
        # slot's object, and each copied matrix's storage and version counter
        mods = list(m.modules())
        slots = [(mod._parameters, n) for mod in mods for n in mod._parameters]
        slots += [(mod._modules, n) for mod in mods for n in mod._modules]
        self._dicts, self._names = tuple(s[0] for s in slots), tuple(s[1] for s in slots)
        self._held = tuple(map(getitem, self._dicts, self._names))
        linears = [lin for b in m.h for lin in (b.attn.c_attn, b.attn.c_proj, b.mlp.c_fc,
                                                b.mlp.c_proj)] + [m.lm_head]
        self._copied = tuple(lin.weight for lin in linears)
        self._stamp = self._versions_and_storage()
        # Decided once, not per layer and step: a step of the site's model is ~100 us.
        self._rope, self._swiglu = cfg.position == "rope", cfg.mlp == "swiglu"
        self._norm = torch.rms_norm if cfg.norm == "rmsnorm" else torch.layer_norm
        self._heads = (cfg.n_head, cfg.n_kv_head, cfg.n_kv_head)  # of Q, K, V in c_attn's output
        with torch.no_grad():
            def t(linear: torch.nn.Linear) -> torch.Tensor:  # [out, in] -> [in, out]
                return linear.weight.detach().t().contiguous()

            def bias(linear: torch.nn.Linear, zeros: bool = True) -> torch.Tensor | None:
                if linear.bias is not None or not zeros:
                    return linear.bias
                return linear.weight.new_zeros(linear.out_features)

            def norm(ln: torch.nn.Module) -> tuple[torch.Tensor, ...]:
                return (ln.weight,) if getattr(ln, "bias", None) is None else (ln.weight, ln.bias)

            self._layers = [
                _Layer(norm(b.ln_1), t(b.attn.c_attn), bias(b.attn.c_attn), t(b.attn.c_proj),
                       bias(b.attn.c_proj, zeros=False), norm(b.ln_2), t(b.mlp.c_fc),
                       bias(b.mlp.c_fc), t(b.mlp.c_proj), bias(b.mlp.c_proj, zeros=False))
                for b in m.h]
            self._ln_f = norm(m.ln_f)
            self._w_head = t(m.lm_head)  # [d, V]
            self._wte, self._wpe = m.wte.weight, None if m.wpe is None else m.wpe.weight

    def _versions_and_storage(self) -> list[int]:
        return [*map(_VERSION, self._copied), *map(_DATA_PTR, self._copied)]

    def _stale(self) -> bool:
        """Whether the model's weights changed since :meth:`refresh` (C-level maps: ~50 ns a
        slot or copied matrix)."""
        held = map(getitem, self._dicts, self._names)
        return not all(map(is_, held, self._held)) or self._versions_and_storage() != self._stamp

    def new_cache(self, batch_size: int, kind: Literal["dynamic", "static", "window"] | None = None,
                  capacity: int | None = None) -> KVCache:
        """The model's :meth:`~kvdoc.core.model.Decoder.new_cache`: the fast step reads and
        writes the same caches."""
        return self.model.new_cache(batch_size, kind, capacity)

    def __call__(self, idx: torch.Tensor, cache: KVCache | None = None, *, last_only: bool = False,
                 positions: torch.Tensor | None = None,
                 attn_mask: torch.Tensor | None = None) -> DecoderOutput:
        """The model's ``forward`` (its output, its refusals); the fast step when ``idx`` is
        ``[B, 1]`` after a cache with neither ``positions`` nor ``attn_mask``."""
        if (cache is None or positions is not None or attn_mask is not None
                or not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.shape[1] != 1
                or invariant.active()):  # the batch-invariant mode is the model's own path
            return self.model(idx, cache, last_only=last_only, positions=positions,
                              attn_mask=attn_mask)  # which checks the call itself
        if self._stale():  # the model's weights changed: copy them again
            self.refresh()
        self.model.check_input(idx, cache)  # the model's checks: the same messages
        if torch.is_grad_enabled():  # it reads parameters: no autograd graph for its logits
            with torch.no_grad():
                return self._step(idx, cache)
        return self._step(idx, cache)

    def _step(self, idx: torch.Tensor, cache: KVCache) -> DecoderOutput:
        """One token per row after ``cache``: logits ``[B, 1, V]``, cache one longer."""
        cfg, norm, heads = self.config, self._norm, self._heads
        rope, swiglu, window = self._rope, self._swiglu, cfg.sliding_window
        B, P, D_h = idx.shape[0], cache.seq_len, cfg.head_dim
        group = cfg.n_head // cfg.n_kv_head  # query heads that read one K/V head
        shape, eps, theta = (cfg.n_embd,), cfg.layer_norm_epsilon, cfg.rope_theta
        try:
            x = self._wte.index_select(0, idx.view(B))  # [B, d]
        except (IndexError, RuntimeError):  # a bad id, or an index dtype it rejects
            embed_tokens(self.model.wte, idx)  # the model's own error; nothing written
            raise
        if self._wpe is not None:
            x = x.add_(self._wpe[P])
        work = cache.begin()
        for i, w in enumerate(self._layers):
            h = norm(x, shape, *w.ln_1, eps)
            qkv = torch.addmm(w.b_qkv, h, w.w_qkv).view(B, -1, 1, D_h)
            q, k, v = qkv.split_with_sizes(heads, dim=1)  # [B, H or H_kv, 1, D_h] views
            if rope:
                q, k = apply_rope(q, P, theta), apply_rope(k, P, theta)
            k, v = work.update(i, k, v, P)  # [B, H_kv, P + 1, D_h]
            if window is not None and k.shape[2] > window:  # a ring holds only W
                k, v = k[:, :, -window:], v[:, :, -window:]
            if group > 1:  # a K/V head's query heads as rows: [B, H_kv, group, D_h]
                q = q.view(B, -1, group, D_h)
            y = F.scaled_dot_product_attention(q, k, v).view(B, -1)  # [B, d]
            x = torch.addmm(x, y, w.w_o)  # residual + attention output
            if w.b_o is not None:
                x = x.add_(w.b_o)
            h = norm(x, shape, *w.ln_2, eps)
            u = torch.addmm(w.b_fc, h, w.w_fc)  # [B, n_inner] ([B, 2 n_inner]: SwiGLU)
            if swiglu:
                gate, up = u.chunk(2, dim=-1)
                u = F.silu(gate).mul_(up)
            else:
                u = F.gelu(u, approximate="tanh")
            x = torch.addmm(x, u, w.w_proj)
            if w.b_proj is not None:
                x = x.add_(w.b_proj)
        logits = torch.mm(norm(x, shape, *self._ln_f, eps), self._w_head)  # [B, V]
        work.finish(P + 1)  # after the head: a failure there leaves the cache as it was
        return DecoderOutput(logits.view(B, 1, -1), work)
