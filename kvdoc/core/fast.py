"""A fast decode step, written the way serving engines write it, for the same function as the model.

:class:`FastDecoder` wraps a :class:`~kvdoc.core.model.Decoder` and is a drop-in for its cached call:
``logits, cache = fast(idx, cache)`` takes and returns the same shapes, refuses the same bad
input with the same messages, and reads and writes the same :class:`~kvdoc.core.cache.KVCache`
objects (K and V ``[B, H_kv, T, D_h]``). A call of one new token per row after a cache runs
the fast step; every other call (a prompt, a chunk of several tokens, no cache) is delegated
to the model itself, since only single-token decode is worth a second implementation.

The fast step does what the reference model leaves out for clarity:

* weights are copied once, flattened and pre-transposed to ``[in, out]`` so every projection
  is one ``torch.addmm`` on 2-D activations ``[B, d]``, not an ``nn.Linear`` module call;
* ``1 / sqrt(D_h)`` is folded into the query columns of ``c_attn`` (weight and bias), so the
  scores need no scaling;
* attention of the one query per head is ``bmm``, ``softmax``, ``bmm``, with the query heads
  of one K/V head stacked as rows (grouped-query and multi-query need no copies of K and V).

It serves every configuration the model does: GPT-2 (learned positions, LayerNorm, GELU) and
Llama-style (RoPE at position ``P``, RMSNorm, SwiGLU, no biases, a sliding window).

It is for inference: its logits carry no autograd graph (the model's own calls, which it
delegates to, do). Its copies cost a second set of weights in memory. Because it copies them,
it checks on every call that the model's modules and parameters are the ones it copied (same
objects, same storage, same version counters) and copies them again if not, so it never
serves stale weights. An in-place edit through ``param.data`` (``p.data.mul_(2)``) bypasses
version counters and cannot be seen; call :meth:`FastDecoder.refresh` after one.

:mod:`kvdoc.proofs.verify` and ``tests/test_fast.py`` prove it computes the model's function.
"""

from __future__ import annotations

import math
from operator import attrgetter, getitem, is_
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

from .cache import KVCache
from .model import Decoder, DecoderOutput, embed_tokens
from .rope import apply_rope

_VERSION = attrgetter("_version")


class _Layer(NamedTuple):
    """One block's weights, each matrix ``[in, out]`` and contiguous; a bias is None without one."""

    ln_1: tuple[torch.Tensor, torch.Tensor | None]
    w_qkv: torch.Tensor  # [d, d + 2 kv_dim], query columns scaled by 1/sqrt(D_h)
    b_qkv: torch.Tensor | None  # [1, d + 2 kv_dim]: a 2-D bias is a little cheaper for addmm
    w_o: torch.Tensor  # [d, d]
    b_o: torch.Tensor | None
    ln_2: tuple[torch.Tensor, torch.Tensor | None]
    w_fc: torch.Tensor  # [d, n_inner] ([d, 2 n_inner] for SwiGLU: gate, then up)
    b_fc: torch.Tensor | None  # [1, n_inner]
    w_proj: torch.Tensor  # [n_inner, d]
    b_proj: torch.Tensor | None


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.mm(x, w) if b is None else torch.addmm(b, x, w)


class FastDecoder:
    """A single-token decode path over a :class:`~kvdoc.core.model.Decoder`'s weights and caches.

    Args:
        model: the decoder whose function this computes; it stays the source of truth.
        pretranspose: store each weight as ``[in, out]`` (else as the model's ``[out, in]``, read
            through a transposed view, which is what ``F.linear`` does).
        fold_scale: fold ``1 / sqrt(D_h)`` into the query weights (else scale the scores).
        bmm_attention: attend with ``bmm``, ``softmax``, ``bmm`` (else with
            ``F.scaled_dot_product_attention``, as the model does).

    The three switches exist to measure what each change buys (the savings page's ablation);
    the defaults are the fast step.

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

    def __init__(self, model: Decoder, *, pretranspose: bool = True, fold_scale: bool = True,
                 bmm_attention: bool = True) -> None:
        if not isinstance(model, Decoder):
            raise ValueError(f"FastDecoder wraps a kvdoc Decoder, got {type(model).__name__}")
        if any(p.is_inference() for p in model.parameters()):
            raise ValueError("the model's parameters were created under torch.inference_mode() and have no "
                             "version counters, so FastDecoder could not see them change; build the model "
                             "outside inference mode")
        self.model = model
        self.config = model.config
        self.pretranspose, self.fold_scale, self.bmm_attention = pretranspose, fold_scale, bmm_attention
        self.refresh()

    def refresh(self) -> None:
        """Copy the model's weights again (done automatically when they change)."""
        m, cfg = self.model, self.model.config
        d, kv = cfg.n_embd, cfg.kv_dim
        self._scale = scale = 1.0 / math.sqrt(cfg.head_dim)
        # decided once, not per layer and step: a step is only ~100 us on the site's model
        self._rope, self._swiglu = cfg.position == "rope", cfg.mlp == "swiglu"
        self._norm_args = ((d,), cfg.layer_norm_epsilon, cfg.norm == "rmsnorm")
        self._params = list(m.parameters())
        slots = [(mod._parameters, name, p) for mod in m.modules() for name, p in mod._parameters.items()]
        slots += [(mod._modules, name, c) for mod in m.modules() for name, c in mod._modules.items()]
        self._slots = tuple(zip(*slots))  # (dicts, names, objects), compared with C-level maps
        self._stamp = self._fingerprint()
        with torch.no_grad():
            q_scale = torch.ones(d + 2 * kv, dtype=m.wte.weight.dtype, device=m.wte.weight.device)
            q_scale[:d] = scale if self.fold_scale else 1.0  # only the query columns

            def t(linear: torch.nn.Linear) -> torch.Tensor:  # [out, in] -> [in, out]
                w = linear.weight.detach()
                return w.t().contiguous() if self.pretranspose else w.clone().t()

            def norm(ln: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:  # LayerNorm or RMSNorm
                bias = getattr(ln, "bias", None)
                return ln.weight.detach().clone(), None if bias is None else bias.detach().clone()

            def bias(linear: torch.nn.Linear, scale: torch.Tensor | None = None) -> torch.Tensor | None:
                if linear.bias is None:
                    return None
                b = linear.bias.detach() * (1.0 if scale is None else scale)
                return b.view(1, -1).clone()

            self._layers = [
                _Layer(norm(b.ln_1), t(b.attn.c_attn).mul_(q_scale), bias(b.attn.c_attn, q_scale),
                       t(b.attn.c_proj), bias(b.attn.c_proj), norm(b.ln_2), t(b.mlp.c_fc), bias(b.mlp.c_fc),
                       t(b.mlp.c_proj), bias(b.mlp.c_proj))
                for b in m.h]
            self._ln_f = norm(m.ln_f)
            self._w_head = t(m.lm_head)  # [d, V]
            self._wte = m.wte.weight.detach()  # [V, d]: a lookup reads it as it is
            self._wpe = None if m.wpe is None else m.wpe.weight.detach()  # [n_positions, d]; None with RoPE

    def _fingerprint(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        # Version counters catch in-place edits (optimizer steps, load_state_dict); data_ptr
        # catches replaced storage (.to(dtype), param.data = ...).
        return tuple(map(_VERSION, self._params)), tuple(map(torch.Tensor.data_ptr, self._params))

    def _current(self) -> None:
        # Every module and parameter must still be the object that was copied (catches e.g.
        # ``model.lm_head.weight = model.wte.weight``), with the same storage and version.
        dicts, names, objects = self._slots
        if not all(map(is_, map(getitem, dicts, names), objects)) or self._fingerprint() != self._stamp:
            self.refresh()

    def new_cache(self, batch_size: int, kind: Literal["dynamic", "static", "window"] | None = None,
                  capacity: int | None = None) -> KVCache:
        """The model's :meth:`~kvdoc.core.model.Decoder.new_cache`: the fast step reads and writes the same caches."""
        return self.model.new_cache(batch_size, kind, capacity)

    def __call__(self, idx: torch.Tensor, cache: KVCache | None = None, *, last_only: bool = False,
                 **hooks: object) -> DecoderOutput:
        """The model's ``forward(idx, cache, last_only=...)``; fast when ``idx`` is ``[B, 1]`` after a cache.

        Any further keyword the model's forward takes (such as per-row positions or an attention
        mask for padded batches), when not None, sends the call to the model.

        Returns:
            ``DecoderOutput(logits, cache)`` exactly as :meth:`Decoder.forward` does.

        Raises:
            ValueError: whatever the model refuses, with the same message, before any write.
        """
        self.model.check_input(idx, cache)
        if cache is None or idx.shape[1] != 1 or any(v is not None for v in hooks.values()):
            return self.model(idx, cache, last_only=last_only, **hooks)  # the model's own path
        self._current()
        return self._step(idx, cache)  # no autograd graph: every weight it reads is a detached copy

    def _step(self, idx: torch.Tensor, cache: KVCache) -> DecoderOutput:
        """One token per row after ``cache``: logits ``[B, 1, V]``, cache one longer."""
        cfg = self.config
        B, d, window = idx.shape[0], cfg.n_embd, cfg.sliding_window
        H_kv, D_h, kv = cfg.n_kv_head, cfg.head_dim, cfg.kv_dim
        group = cfg.n_head // H_kv  # query heads that read one K/V head
        P = cache.seq_len
        try:
            tok = self._wte.index_select(0, idx.view(B))  # [B, d]
        except (IndexError, RuntimeError):  # a bad id, or an index dtype it rejects
            embed_tokens(self.model.wte, idx)  # the model's own error; nothing written
            raise
        work = cache.begin()
        x = tok if self._wpe is None else tok + self._wpe[P]  # [B, d]
        for layer_idx, w in enumerate(self._layers):
            h = self._norm(x, w.ln_1)
            qkv = _linear(h, w.w_qkv, w.b_qkv)  # [B, d + 2 kv]: Q (pre-scaled), K, V
            q = qkv[:, :d].view(B, cfg.n_head, 1, D_h)
            k = qkv[:, d:d + kv].view(B, H_kv, 1, D_h)
            v = qkv[:, d + kv:].view(B, H_kv, 1, D_h)
            if self._rope:  # a rotation commutes with the folded scale
                theta = cfg.rope_theta
                q, k = apply_rope(q, P, theta), apply_rope(k, P, theta)
            k, v = work.update(layer_idx, k, v, P)  # [B, H_kv, P + 1, D_h]
            if window is not None and k.shape[2] > window:  # a ring holds only W
                k, v = k[:, :, -window:], v[:, :, -window:]
            T = k.shape[2]
            if self.bmm_attention:
                # a K/V head's query heads as rows of one matrix: [B H_kv, group, D_h]
                q = q.reshape(B * H_kv, group, D_h)
                k, v = k.reshape(B * H_kv, T, D_h), v.reshape(B * H_kv, T, D_h)
                scores = torch.bmm(q, k.transpose(1, 2))  # [B H_kv, group, T]
                if not self.fold_scale:
                    scores = scores.mul_(self._scale)
                y = torch.bmm(torch.softmax(scores, dim=-1), v).view(B, d)  # merged
            else:
                gqa = {"enable_gqa": True} if group > 1 else {}  # as the model does
                scale = 1.0 if self.fold_scale else None
                y = F.scaled_dot_product_attention(q, k, v, scale=scale, **gqa)
                y = y.reshape(B, d)
            x = torch.addmm(x, y, w.w_o)  # residual + attention output
            x = x if w.b_o is None else x.add_(w.b_o)
            h = self._norm(x, w.ln_2)
            u = _linear(h, w.w_fc, w.b_fc)  # [B, n_inner] ([B, 2 n_inner] for SwiGLU)
            if self._swiglu:
                gate, up = u.chunk(2, dim=-1)
                u = F.silu(gate) * up
            else:
                u = F.gelu(u, approximate="tanh")
            x = torch.addmm(x, u, w.w_proj)
            x = x if w.b_proj is None else x.add_(w.b_proj)
        work.finish(P + 1)
        h = self._norm(x, self._ln_f)
        logits = torch.mm(h, self._w_head).view(B, 1, -1)  # [B, 1, V]
        return DecoderOutput(logits, work)

    def _norm(self, x: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        shape, eps, rms = self._norm_args
        if rms:
            return F.rms_norm(x, shape, weights[0], eps)
        return torch.layer_norm(x, shape, weights[0], weights[1], eps)
