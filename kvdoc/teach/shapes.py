"""The shapes of one forward pass through the decoder, measured on a model, step by step: what
each step is, the class of operation and its output shape (:func:`gpt2_shapes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdoc.core.model import Decoder
from kvdoc.teach.decoder_sites import decoder_values


@dataclass(frozen=True)
class ShapeRow:
    """One step of the forward pass: what it is, which class of operation, its output shape."""

    step: str
    op_class: str
    shape: tuple[int, ...]
    symbols: str


def gpt2_shapes(model: Decoder, idx: torch.Tensor, layer: int = 0) -> list[ShapeRow]:
    """The shapes of one full forward of ``idx`` (``[B, T]``), measured on ``model``, in forward
    order.

    The decoder layer is shown once (layer ``layer``); the head split, the scores and the
    attention weights are measured on that layer's real Q and K. Ends with the last-row slice
    and the LM head of next-token prediction.

    >>> from kvdoc import GPTConfig
    >>> rows = gpt2_shapes(Decoder(GPTConfig()), torch.tensor([[1, 2, 3]]))
    >>> rows[-1].shape
    (1, 97)
    """
    cfg = model.config
    with torch.no_grad():
        v = decoder_values(model, idx)
        B, T = idx.shape
        H, Hkv, Dh = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        q = v[f"h{layer}.q"].view(B, T, H, Dh).transpose(1, 2)  # [B, H, T, D_h]
        k = v[f"h{layer}.k"].view(B, T, Hkv, Dh).transpose(1, 2)  # [B, H_kv, T, D_h]
        k = k.repeat_interleave(H // Hkv, dim=1)
        scores = q @ k.transpose(-2, -1)  # [B, H, T, T]
        last = v["ln_f.out"][:, -1, :]  # [B, d]
        logits = model.lm_head(last)  # [B, V]
    h = f"h{layer}"
    return [
        ShapeRow("token ids", "input", tuple(idx.shape), "B, T"),
        ShapeRow("token embedding wte", "lookup (row-local)", tuple(v["wte"].shape),
                 "T, d_model (broadcast over B)" if v["wte"].dim() == 2 else "B, T, d_model"),
        ShapeRow("position embedding wpe", "lookup (row-local)", tuple(v["wpe"].shape),
                 "T, d_model"),
        ShapeRow("wte + wpe", "element-wise", tuple(v["embed"].shape), "B, T, d_model"),
        ShapeRow(f"{h}: ln_1", "row-wise", tuple(v[f"{h}.ln_1"].shape), "B, T, d_model"),
        ShapeRow(f"{h}: Q = ln_1 @ W_q", "matmul by a weight", tuple(v[f"{h}.q"].shape),
                 "B, T, H·d_k"),
        ShapeRow(f"{h}: K = ln_1 @ W_k", "matmul by a weight", tuple(v[f"{h}.k"].shape),
                 "B, T, H_kv·d_k"),
        ShapeRow(f"{h}: V = ln_1 @ W_v", "matmul by a weight", tuple(v[f"{h}.v"].shape),
                 "B, T, H_kv·d_k"),
        ShapeRow(f"{h}: split heads of Q", "reshape (row-local)", tuple(q.shape), "B, H, T, d_k"),
        ShapeRow(f"{h}: scores = Q K^T / sqrt(d_k)", "matmul of two activations",
                 tuple(scores.shape), "B, H, T, T"),
        ShapeRow(f"{h}: softmax(masked scores) @ V, heads merged", "matmul of two activations",
                 tuple(v[f"{h}.heads"].shape), "B, T, d_model"),
        ShapeRow(f"{h}: c_proj, + residual", "matmul by a weight; element-wise",
                 tuple(v[f"{h}.mid"].shape), "B, T, d_model"),
        ShapeRow(f"{h}: ln_2", "row-wise", tuple(v[f"{h}.ln_2"].shape), "B, T, d_model"),
        ShapeRow(f"{h}: MLP up c_fc, GELU", "matmul by a weight; element-wise",
                 tuple(v[f"{h}.fc"].shape), "B, T, d_ff"),
        ShapeRow(f"{h}: MLP down c_proj, + residual", "matmul by a weight; element-wise",
                 tuple(v[f"{h}.out"].shape), "B, T, d_model"),
        ShapeRow("ln_f (after the last layer)", "row-wise", tuple(v["ln_f.out"].shape),
                 "B, T, d_model"),
        ShapeRow("last row x[:, -1, :]", "slice", tuple(last.shape), "B, d_model"),
        ShapeRow("LM head", "matmul by a weight", tuple(logits.shape), "B, V"),
    ]
