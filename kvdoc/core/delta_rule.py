"""The gated delta rule, the fold a Gated DeltaNet layer keeps (:mod:`kvdoc.core.deltanet`), in
two forms that compute one function: a token at a time (:func:`recurrent_delta_rule`, a decode
step's) and a chunk at a time in matrix products (:func:`chunked_delta_rule`, a prefill's).

With ``q``, ``k`` L2-normed, a decay ``g <= 0`` and a rate ``beta`` per token and head, the state
``S`` (``[D_k, D_v]`` per head) after token ``t`` is

``S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T``, and ``o_t = S_t^T q_t``:

each token writes into ``S`` only the part of ``v_t`` that the decayed state does not already
predict from ``k_t`` (the delta rule).
"""

from __future__ import annotations

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (FLA's and transformers' epsilon)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def recurrent_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, state: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule a token at a time: ``q``, ``k`` ``[B, H, C, D_k]``, ``v``
    ``[B, H, C, D_v]``, ``g``, ``beta`` ``[B, H, C]``, ``state`` ``[B, H, D_k, D_v]``; returns
    the outputs ``[B, H, C, D_v]`` and the state after the last token."""
    out = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t, None, None].exp()
        remembered = (k[:, :, t, :, None] * state).sum(-2)  # S^T k: [B, H, D_v]
        delta = (v[:, :, t] - remembered) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        out.append((q[:, :, t, :, None] * state).sum(-2))
    return torch.stack(out, dim=2), state


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, state: torch.Tensor, chunk_size: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`recurrent_delta_rule` ``chunk_size`` tokens at a time, in matrix products.

    Within a chunk, with ``G_t`` the cumulative log-decay from its start, the state after token
    ``t`` is ``exp(G_t) S_0 + sum_{s <= t} exp(G_t - G_s) k_s u_s^T``: the new values ``u``
    solve a unit lower-triangular system (``u_t`` corrects what the state before ``t`` already
    predicts), and the outputs and the next chunk's state are products with ``u``.

    >>> g = torch.Generator().manual_seed(0)
    >>> q, k = (torch.nn.functional.normalize(torch.randn(1, 2, 7, 4, generator=g), dim=-1)
    ...         for _ in range(2))
    >>> v, s = torch.randn(1, 2, 7, 3, generator=g), torch.randn(1, 2, 4, 3, generator=g)
    >>> decay, beta = -torch.rand(1, 2, 7, generator=g), torch.rand(1, 2, 7, generator=g)
    >>> a, b = chunked_delta_rule(q, k, v, decay, beta, s, 3), recurrent_delta_rule(
    ...     q, k, v, decay, beta, s)
    >>> all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a, b))
    True
    """
    outs = []
    for at in range(0, q.shape[2], chunk_size):
        piece = slice(at, at + chunk_size)
        qc, kc, vc, bc = q[:, :, piece], k[:, :, piece], v[:, :, piece], beta[:, :, piece]
        G = g[:, :, piece].cumsum(-1)  # [B, H, L]
        L = G.shape[-1]
        later = torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1)  # s > t
        decay = (G[..., :, None] - G[..., None, :]).masked_fill(later, -torch.inf).exp()
        kk = (kc @ kc.transpose(-1, -2)) * decay  # exp(G_t - G_s) k_t . k_s for s <= t
        system = torch.eye(L, dtype=q.dtype, device=q.device) + (bc[..., None] * kk).tril(-1)
        rhs = bc[..., None] * (vc - G.exp()[..., None] * (kc @ state))
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        qk = (qc @ kc.transpose(-1, -2)) * decay  # s <= t, the token's own included
        outs.append(G.exp()[..., None] * (qc @ state) + qk @ u)
        last = G[..., -1:]  # [B, H, 1]
        state = (last.exp()[..., None] * state
                 + (kc * (last - G).exp()[..., None]).transpose(-1, -2) @ u)
    return torch.cat(outs, dim=2), state
