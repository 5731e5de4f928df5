"""Sites inside the real decoder: any intermediate tensor as the input of a plain function.

:func:`decoder_function` turns a *site* of a :class:`~kvdoc.core.model.Decoder` (one layer's Q,
K or V, the residual stream, ...: :func:`decoder_sites`) into a function of that tensor, forward
hooks replacing the site's value so that the real modules compute. It can also *pin* other sites
at their values from a normal run: "given every layer's K and V". Layers count from 0 (``h0``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvdoc.core.model import Decoder

Fn = Callable[[torch.Tensor], torch.Tensor]

def _site_spec(model: Decoder, site: str) -> tuple[str, str, slice | None]:
    """``(module name, "in" | "out", column slice)`` for a site name."""
    cfg = model.config
    fixed = {"embed": ("h.0", "in"), "wte": ("wte", "out"), "wpe": ("wpe", "out"),
             "ln_f.in": ("ln_f", "in"), "ln_f.out": ("lm_head", "in"), "logits": ("lm_head", "out")}
    if site in fixed:
        return (*fixed[site], None)
    layer, _, part = site.partition(".")
    if not (layer.startswith("h") and layer[1:].isdigit() and int(layer[1:]) < cfg.n_layer):
        raise ValueError(f"unknown site {site!r}; see decoder_sites()")
    h = f"h.{int(layer[1:])}"
    d, kv = cfg.n_embd, cfg.kv_dim
    parts = {"in": (h, "in", None), "ln_1": (f"{h}.ln_1", "out", None),
             "q": (f"{h}.attn.c_attn", "out", slice(0, d)),
             "k": (f"{h}.attn.c_attn", "out", slice(d, d + kv)),
             "v": (f"{h}.attn.c_attn", "out", slice(d + kv, d + 2 * kv)),
             "heads": (f"{h}.attn.c_proj", "in", None), "attn": (f"{h}.attn", "out", None),
             "mid": (f"{h}.ln_2", "in", None), "ln_2": (f"{h}.ln_2", "out", None),
             "fc": (f"{h}.mlp.c_fc", "out", None), "mlp": (f"{h}.mlp", "out", None),
             "out": (h, "out", None)}
    if part not in parts:
        raise ValueError(f"unknown site {site!r}; see decoder_sites()")
    return parts[part]


def decoder_sites(model: Decoder) -> list[str]:
    """Every site name :func:`decoder_function` accepts, in the order the forward pass meets them:
    ``embed`` is ``wte + wpe``; ``h{l}.q/k/v`` one layer's Q, K, V with heads merged;
    ``h{l}.heads`` the attention output before ``c_proj``; ``h{l}.mid`` the residual stream
    between attention and MLP; ``ln_f.out`` the LM head's input."""
    per = ["in", "ln_1", "q", "k", "v", "heads", "attn", "mid", "ln_2", "fc", "mlp", "out"]
    return (["wte", "wpe", "embed"]
            + [f"h{i}.{p}" for i in range(model.config.n_layer) for p in per]
            + ["ln_f.in", "ln_f.out", "logits"])


class _Hooks:
    """Forward hooks that record and replace sites of a decoder for one call."""

    def __init__(self, model: Decoder, replace: dict[str, torch.Tensor],
                 record: Sequence[str]) -> None:
        self.model, self.values, self.handles = model, {}, []
        modules = dict(model.named_modules())
        by_module: dict[tuple[str, str], list[tuple[str, slice | None, torch.Tensor | None]]] = {}
        for site in set(replace) | set(record):
            name, where, cols = _site_spec(model, site)
            by_module.setdefault((name, where), []).append((site, cols, replace.get(site)))
        for (name, where), items in by_module.items():
            mod = modules[name]
            if where == "in":
                self.handles.append(mod.register_forward_pre_hook(self._pre(items)))
            else:
                self.handles.append(mod.register_forward_hook(self._post(items)))

    def _apply(self, t: torch.Tensor, items) -> torch.Tensor:
        for _site, cols, new in items:
            if new is not None:
                if cols is None:
                    t = new.expand_as(t) if new.shape != t.shape else new
                else:
                    t = torch.cat([t[..., : cols.start], new, t[..., cols.stop:]], dim=-1)
        for site, cols, _ in items:
            self.values[site] = t if cols is None else t[..., cols]
        return t

    def _pre(self, items):
        def hook(module, args):
            return (self._apply(args[0], items), *args[1:])
        return hook

    def _post(self, items):
        def hook(module, args, output):
            return self._apply(output, items)
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def float64_copy(model: Decoder) -> Decoder:
    """A float64 copy of ``model`` in eval mode (the original is untouched)."""
    return copy.deepcopy(model).to(torch.float64).eval()


def decoder_values(model: Decoder, idx: torch.Tensor, sites: Sequence[str] | None = None,
                   replace: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Run ``model(idx)`` (full recompute) and return the value of each site (default: all).

    ``replace`` substitutes tensors for sites during the run (shapes as recorded).

    >>> from kvdoc import GPTConfig
    >>> _ = torch.manual_seed(0)
    >>> values = decoder_values(Decoder(GPTConfig()), torch.tensor([[5, 6, 7]]), ["h0.k", "logits"])
    >>> tuple(values["h0.k"].shape), tuple(values["logits"].shape)
    ((1, 3, 64), (1, 3, 97))
    """
    sites = decoder_sites(model) if sites is None else list(sites)
    hooks = _Hooks(model, replace or {}, sites)
    try:
        model(idx)
    finally:
        hooks.close()
    return {s: hooks.values[s] for s in sites}


def decoder_function(model: Decoder, idx: torch.Tensor, site: str, output: str = "logits",
                     pin: Sequence[str] = ()) -> tuple[Fn, torch.Tensor]:
    """The decoder (a float64 copy of ``model``) as a function of one internal tensor:
    ``(fn, x0)``, ``x0`` the value of ``site`` in ``model(idx)`` and ``fn(x)`` the ``output`` of
    a rerun with ``site`` replaced by ``x`` and each site in ``pin`` held at its value.

    >>> from kvdoc import GPTConfig
    >>> _ = torch.manual_seed(0)
    >>> from kvdoc.teach.dependency_maps import dependency_map
    >>> small = Decoder(GPTConfig(n_embd=8, n_head=2, n_inner=16))
    >>> fn, k0 = decoder_function(small, torch.tensor([[5, 6, 7]]), "h1.k")
    >>> m = dependency_map(fn, k0, out_rows=[-1])      # last logits row over layer 1's K rows
    >>> m.rows_needed()
    [0, 1, 2]
    """
    model = float64_copy(model)
    recorded = decoder_values(model, idx, [site, output, *pin])
    fixed = {p: recorded[p].detach() for p in pin if p != site}

    def fn(x: torch.Tensor) -> torch.Tensor:
        return decoder_values(model, idx, [output], {**fixed, site: x})[output]

    return fn, recorded[site].detach()


@dataclass(frozen=True)
class KVRowChanges:
    """Which cached K/V rows an edit of the prompt changes: the largest change of each layer's
    K (or V) row, float64 ``[L, T]``, and where it is above ``atol``."""

    k_change: torch.Tensor
    v_change: torch.Tensor
    k_changed: torch.Tensor
    v_changed: torch.Tensor


@torch.no_grad()
def kv_rows_changed(model: Decoder, idx: torch.Tensor, edited: torch.Tensor,
                    atol: float = 0.0) -> KVRowChanges:
    """Prefill both prompts (``[B, T]``) on a float64 copy of ``model`` and compare every
    layer's cached K and V rows; with ``atol=0`` a row "changed" unless bit-for-bit equal.

    >>> from kvdoc import GPTConfig
    >>> _ = torch.manual_seed(0)
    >>> e = kv_rows_changed(Decoder(GPTConfig()), torch.tensor([[1, 2, 3]]),
    ...                     torch.tensor([[1, 9, 3]]))
    >>> # layer 0: only the edited row; layer 1: it and every later row
    >>> e.k_changed.int().tolist()
    [[0, 1, 0], [0, 1, 1]]
    """
    if idx.shape != edited.shape:
        raise ValueError(f"the prompts must have one shape, got {tuple(idx.shape)} "
                         f"and {tuple(edited.shape)}")
    m = float64_copy(model)
    a, b = (m(ids, m.new_cache(ids.shape[0])).cache for ids in (idx, edited))
    diffs = []
    for which in (0, 1):  # K, V: [B, H_kv, T, D_h] -> largest change per position: [L, T]
        diffs.append(torch.stack([(a.layer(i)[which] - b.layer(i)[which]).abs().amax(dim=(0, 1, 3))
                                  for i in range(m.config.n_layer)]))
    return KVRowChanges(diffs[0], diffs[1], diffs[0] > atol, diffs[1] > atol)


@dataclass(frozen=True)
class ShapeRow:
    """One step of the forward pass: what it is, which class of operation, its output shape."""

    step: str
    op_class: str
    shape: tuple[int, ...]
    symbols: str


def gpt2_shapes(model: Decoder, idx: torch.Tensor, layer: int = 0) -> list[ShapeRow]:
    """The shapes of one full forward of ``idx`` (``[B, T]``), measured on ``model``, in forward
    order: one decoder layer (``layer``), then the last-row slice, the final norm and the LM
    head, in the order ``last_only`` runs them (ln_f is row-wise, so the slice may come first).

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
        last = v[f"h{cfg.n_layer - 1}.out"][:, -1, :]  # [B, d]: the last layer's last row
        normed = model.ln_f(last)  # [B, d]
        logits = model.lm_head(normed)  # [B, V]
    h, btd = f"h{layer}", "B, T, d_model"
    weight, act, add = "matmul by a weight", "matmul of two activations", "; element-wise"
    rows = [
        ("token ids", "input", idx, "B, T"),
        ("token embedding wte", "lookup (row-local)", v["wte"],
         "T, d_model (broadcast over B)" if v["wte"].dim() == 2 else btd),
        ("position embedding wpe", "lookup (row-local)", v["wpe"], "T, d_model"),
        ("wte + wpe", "element-wise", v["embed"], btd),
        (f"{h}: ln_1", "row-wise", v[f"{h}.ln_1"], btd),
        (f"{h}: Q = ln_1 @ W_q", weight, v[f"{h}.q"], "B, T, H·D_h"),
        (f"{h}: K = ln_1 @ W_k", weight, v[f"{h}.k"], "B, T, H_kv·D_h"),
        (f"{h}: V = ln_1 @ W_v", weight, v[f"{h}.v"], "B, T, H_kv·D_h"),
        (f"{h}: split heads of Q", "reshape (row-local)", q, "B, H, T, D_h"),
        (f"{h}: scores = Q K^T / sqrt(D_h)", act, scores, "B, H, T, T"),
        (f"{h}: softmax(masked scores) @ V, heads merged", act, v[f"{h}.heads"], btd),
        (f"{h}: c_proj, + residual", weight + add, v[f"{h}.mid"], btd),
        (f"{h}: ln_2", "row-wise", v[f"{h}.ln_2"], btd),
        (f"{h}: MLP up c_fc, GELU", weight + add, v[f"{h}.fc"], "B, T, d_ff"),
        (f"{h}: MLP down c_proj, + residual", weight + add, v[f"{h}.out"], btd),
        ("last row x[:, -1, :] (after the last layer)", "slice", last, "B, d_model"),
        ("ln_f", "row-wise", normed, "B, d_model"),
        ("LM head", weight, logits, "B, V"),
    ]
    return [ShapeRow(step, op, tuple(t.shape), symbols) for step, op, t, symbols in rows]
