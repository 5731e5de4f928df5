"""Dependency maps: which rows of the input does each row of the output depend on?

A *row* is one position (an index along dim -2). Row ``t`` of ``f``'s output depends on row
``s`` of its input when the Jacobian block ``d f[..., t, :] / d x[..., s, :]`` is not zero,
found two independent ways: exactly from autograd (:func:`jacobian_map`), and by nudging one
input coordinate at a time without autograd (:func:`perturbation_map`); :func:`compare_maps`
checks they agree. Everything runs in float64, so "does not depend" is an exact zero. A map is
local to the given ``x``: a saturated softmax can make a block vanish at one ``x``, so analyse
inputs of moderate size.

:func:`token_dependency_map` does the same for discrete token ids, by replacing one id at a
time. To map the tensors *inside* the real decoder, :mod:`kvdoc.teach.decoder_sites` turns any of
them into the input of a plain function that these maps accept.

What a hybrid decoder's cache stores, tensor by tensor (:func:`stored`: ``"h1 K/V 3"``, layer 1's
keys and values at position 3; ``"h0 recurrent"``, a state layer's named tensor), and which of
those change when one token of the prompt does (:func:`changed_by_token`, bit for bit): Part VI's
check that a K/V row is a function of its own position's prefix and a recurrent state of the
whole prefix. What a token cannot reach is computed from the same inputs by the same operations,
so it comes out identical; what it reaches moves, if only a little (a gated state forgets old
tokens gradually, never entirely).

>>> from kvdoc.core.deltanet import DeltaNetConfig, DeltaNetDecoder
>>> _ = torch.manual_seed(0)
>>> config = DeltaNetConfig(layer_types=("linear_attention", "full_attention"))
>>> model = DeltaNetDecoder(config).double().eval()
>>> names, changed = changed_by_token(model, torch.tensor([[5, 9, 2, 7]]))
>>> names
['h0 conv', 'h0 recurrent', 'h1 K/V 0', 'h1 K/V 1', 'h1 K/V 2', 'h1 K/V 3']
>>> changed.int()          # a row per stored tensor, a column per replaced token
tensor([[0, 1, 1, 1],
        [1, 1, 1, 1],
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 1, 1, 0],
        [1, 1, 1, 1]], dtype=torch.int32)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvdoc.core.cache import KVCache
from kvdoc.core.state import StateLayer, read_state
from kvdoc.teach.display import html_table

Fn = Callable[[torch.Tensor], torch.Tensor]

DEFAULT_RTOL = 1e-10
"""A block counts as a dependency when its magnitude exceeds this fraction of the largest block."""


@dataclass(frozen=True)
class DependencyMap:
    """``depends[t, s]`` (bool ``[T_out, T_in]``) and ``magnitude``, the Frobenius norm of the
    Jacobian block of output row ``t`` over input row ``s`` (zero exactly where no dependency);
    ``out_rows``: the output rows the matrix's rows stand for; labels for renderers."""

    depends: torch.Tensor
    magnitude: torch.Tensor
    method: str
    out_rows: tuple[int, ...]
    in_labels: tuple[str, ...]
    out_labels: tuple[str, ...]

    @property
    def shape(self) -> tuple[int, int]:
        """``(T_out, T_in)``."""
        return tuple(self.depends.shape)  # type: ignore[return-value]

    def rows_needed(self, out_row: int = -1) -> list[int]:
        """Input rows that output row ``out_row`` (an index into the matrix) depends on."""
        return [int(s) for s in torch.nonzero(self.depends[out_row]).flatten()]

    def relabel(self, in_labels: Sequence[str] | None = None,
                out_labels: Sequence[str] | None = None) -> DependencyMap:
        """The same map with other row names."""
        ins = tuple(in_labels) if in_labels is not None else self.in_labels
        outs = tuple(out_labels) if out_labels is not None else self.out_labels
        if len(ins) != self.shape[1] or len(outs) != self.shape[0]:
            raise ValueError(f"need {self.shape[1]} input and {self.shape[0]} output labels")
        return DependencyMap(self.depends, self.magnitude, self.method, self.out_rows, ins, outs)

    def heatmap(self, ax=None, title: str | None = None):
        """The magnitudes relative to the largest block, on a log scale; cells without a
        dependency white. Returns the matplotlib figure."""
        import matplotlib.pyplot as plt
        import numpy as np

        if ax is None:
            fig, ax = plt.subplots(figsize=(0.45 * self.shape[1] + 2.2, 0.45 * self.shape[0] + 1.4))
        else:
            fig = ax.figure
        mag = self.magnitude.detach().cpu().numpy()
        dep = self.depends.cpu().numpy()
        top = mag.max() if mag.size and mag.max() > 0 else 1.0
        shown = np.where(dep, np.log10(np.maximum(mag / top, 1e-300)), np.nan)
        cmap = plt.get_cmap("viridis").with_extremes(bad="white")
        # one scale for every map, so panels compare
        im = ax.imshow(np.ma.masked_invalid(shown), cmap=cmap, aspect="equal", vmin=-4.0, vmax=0.0)
        ax.set_xticks(range(self.shape[1]), self.in_labels)
        ax.set_yticks(range(self.shape[0]), self.out_labels)
        ax.set_xticks(np.arange(-0.5, self.shape[1]), minor=True)
        ax.set_yticks(np.arange(-0.5, self.shape[0]), minor=True)
        ax.grid(which="minor", color="0.8", linewidth=0.5)
        ax.tick_params(which="minor", length=0)
        ax.set_xlabel("input row")
        ax.set_ylabel("output row")
        if title:
            ax.set_title(title)
        bar = fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
        bar.set_label("log10(block norm / largest)")
        return fig


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError("the input must be a [T, d] or [B, T, d] tensor (rows on dim -2), "
                         f"got {shape}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"the input must be floating point, got {x.dtype}")
    return x.detach().to(torch.float64)


def _out_rows(y: torch.Tensor, out_rows: Sequence[int] | None,
              row_dim: int | None) -> tuple[int, ...]:
    n = 1 if row_dim is None else y.shape[row_dim]
    rows = range(n) if out_rows is None else out_rows
    picked = tuple(int(r) % n if -n <= int(r) < n else -1 for r in rows)
    if -1 in picked:
        raise ValueError(f"output rows {list(rows)} out of range for {n} rows")
    return picked


def _row_view(y: torch.Tensor, row_dim: int | None) -> torch.Tensor:
    """``y`` with rows first and everything else flattened: ``[T_out, -1]``."""
    if row_dim is None:
        return y.reshape(1, -1)
    return y.movedim(row_dim, 0).reshape(y.shape[row_dim], -1)


def _finish(mag: torch.Tensor, method: str, rows: tuple[int, ...], rtol: float) -> DependencyMap:
    top = float(mag.max()) if mag.numel() else 0.0
    depends = mag > rtol * top if top > 0 else torch.zeros_like(mag, dtype=torch.bool)
    return DependencyMap(depends, torch.where(depends, mag, torch.zeros_like(mag)), method, rows,
                         tuple(str(s) for s in range(mag.shape[1])), tuple(str(t) for t in rows))


def jacobian_map(fn: Fn, x: torch.Tensor, *, out_rows: Sequence[int] | None = None,
                 out_row_dim: int | None = -2, rtol: float = DEFAULT_RTOL) -> DependencyMap:
    """The dependency map of ``fn`` at ``x`` (in float64), exactly, from the autograd Jacobian,
    for ``out_rows`` (default all) along output dimension ``out_row_dim`` (None: the whole output
    is one row, e.g. ``x[:, -1, :]``).

    >>> x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    >>> m = jacobian_map(lambda x: x.cumsum(dim=0), x)     # row t is the sum of rows 0..t
    >>> m.depends.int()
    tensor([[1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 1, 1, 0],
            [1, 1, 1, 1]], dtype=torch.int32)
    """
    x = _as_rows(x)
    rows = _out_rows(fn(x), out_rows, out_row_dim)
    index = torch.tensor(rows)

    def picked(z: torch.Tensor) -> torch.Tensor:
        return _row_view(fn(z), out_row_dim)[index]  # [T_sel, k]

    try:
        jac = torch.autograd.functional.jacobian(picked, x, vectorize=True)
    except RuntimeError:  # an op without a batching rule: fall back to one backward per element
        jac = torch.autograd.functional.jacobian(picked, x)
    # jac: [T_sel, k, *x.shape] -> rows of x first: [T_sel, k, T_in, rest]
    jac = jac.movedim(2 + x.dim() - 2, 2).reshape(len(rows), -1, x.shape[-2], x[..., 0, :].numel())
    mag = jac.pow(2).sum(dim=(1, 3)).sqrt()  # [T_sel, T_in]
    return _finish(mag, "jacobian", rows, rtol)


@torch.no_grad()
def perturbation_map(fn: Fn, x: torch.Tensor, *, out_rows: Sequence[int] | None = None,
                     out_row_dim: int | None = -2, rtol: float = DEFAULT_RTOL,
                     eps: float = 1e-7) -> DependencyMap:
    """The dependency map of ``fn`` at ``x`` without autograd, moving each input coordinate in
    turn by ``eps``: the pattern is exact, the magnitudes match :func:`jacobian_map` to about
    ``eps`` (relative).

    >>> x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    >>> m = perturbation_map(lambda x: x.cumsum(dim=0), x)
    >>> m.rows_needed(-1), m.rows_needed(0)
    ([0, 1, 2, 3], [0])
    """
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    x = _as_rows(x)
    base = fn(x).to(torch.float64)
    rows = _out_rows(base, out_rows, out_row_dim)
    index = torch.tensor(rows)
    n_in = x.shape[-2]
    mag = torch.zeros(len(rows), n_in, dtype=torch.float64)
    for s in range(n_in):
        row_shape = x[..., s, :].shape  # the leading dims and d
        for flat in range(x[..., s, :].numel()):
            *lead, j = torch.unravel_index(torch.tensor(flat), row_shape)
            delta = torch.zeros_like(x)
            delta[(*lead, s, j)] = eps  # one coordinate of input row s
            diff = _row_view(fn(x + delta).to(torch.float64) - base, out_row_dim)
            mag[:, s] += (diff[index] / eps).pow(2).sum(dim=1)
    return _finish(mag.sqrt(), "perturbation", rows, rtol)


@dataclass(frozen=True)
class Agreement:
    """What :func:`compare_maps` found: the same pattern, the largest ``|a - b| / max|a|``."""

    same_pattern: bool
    max_rel_diff: float
    ok: bool

    def check(self) -> Agreement:
        """Return ``self``, or raise ``AssertionError`` when the two methods disagree."""
        if not self.ok:
            raise AssertionError(f"dependency maps disagree: same pattern {self.same_pattern}, "
                                 f"largest relative magnitude difference {self.max_rel_diff:.3e}")
        return self


def compare_maps(a: DependencyMap, b: DependencyMap, rtol: float = 1e-5) -> Agreement:
    """Whether two maps of one function agree, in pattern exactly and in magnitude within
    ``rtol``.

    >>> m = jacobian_map(lambda x: 2 * x, torch.ones(2, 1))
    >>> compare_maps(m, perturbation_map(lambda x: 2 * x, torch.ones(2, 1))).ok
    True
    """
    if a.shape != b.shape or a.out_rows != b.out_rows:
        raise ValueError(f"maps of different rows: {a.shape} {a.out_rows} "
                         f"vs {b.shape} {b.out_rows}")
    same = bool(torch.equal(a.depends, b.depends))
    top = float(a.magnitude.abs().max()) or 1.0
    rel = float((a.magnitude - b.magnitude).abs().max()) / top if a.magnitude.numel() else 0.0
    return Agreement(same, rel, same and rel <= rtol)


@dataclass(frozen=True)
class CheckedMap:
    """What :func:`dependency_map` returns: both maps and their agreement."""

    jacobian: DependencyMap
    perturbation: DependencyMap
    agreement: Agreement

    @property
    def depends(self) -> torch.Tensor:
        """The agreed boolean ``[T_out, T_in]`` matrix."""
        return self.jacobian.depends

    def rows_needed(self, out_row: int = -1) -> list[int]:
        """Input rows that output row ``out_row`` (an index into the matrix) depends on."""
        return self.jacobian.rows_needed(out_row)


def dependency_map(fn: Fn, x: torch.Tensor, **kwargs) -> CheckedMap:
    """Both maps of ``fn`` at ``x``, checked to agree (raises ``AssertionError`` if not).

    Takes the keyword arguments of :func:`jacobian_map`.

    >>> W = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    >>> x = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(1))   # [B, T, d]
    >>> m = dependency_map(lambda x: x @ W, x)       # a matmul by a fixed weight: row-local
    >>> bool(torch.equal(m.depends, torch.eye(4, dtype=torch.bool)))
    True
    """
    a = jacobian_map(fn, x, **kwargs)
    b = perturbation_map(fn, x, **kwargs)
    return CheckedMap(a, b, compare_maps(a, b).check())


def lower_triangular(n_out: int, n_in: int | None = None) -> torch.Tensor:
    """The causal pattern: bool ``[n_out, n_in]``, True where ``s <= t + (n_in - n_out)``.

    >>> lower_triangular(2, 3).int().tolist()
    [[1, 1, 0], [1, 1, 1]]
    """
    n_in = n_out if n_in is None else n_in
    return torch.ones(n_out, n_in, dtype=torch.bool).tril(diagonal=n_in - n_out)


@torch.no_grad()
def token_dependency_map(fn: Callable[[torch.Tensor], torch.Tensor], idx: torch.Tensor,
                         vocab_size: int, *, out_row_dim: int | None = -2) -> DependencyMap:
    """Which token positions of ``idx`` (``[B, T]``) each output row depends on: position ``s``
    is replaced by ``(id + 1) % vocab_size`` and the change of each output row is its magnitude.
    One replacement: a zero is evidence, not proof.

    >>> emb = torch.nn.Embedding(10, 4)
    >>> m = token_dependency_map(emb, torch.tensor([[1, 2, 3]]), 10)   # a lookup is row-local
    >>> m.depends.int().tolist()
    [[1, 0, 0], [0, 1, 0], [0, 0, 1]]
    """
    if idx.dim() != 2 or idx.dtype.is_floating_point:
        raise ValueError("idx must be [B, T] integer token ids, "
                         f"got {tuple(idx.shape)} {idx.dtype}")
    base = fn(idx).to(torch.float64)
    rows = _out_rows(base, None, out_row_dim)
    T = idx.shape[1]
    mag = torch.zeros(len(rows), T, dtype=torch.float64)
    for s in range(T):
        edited = idx.clone()
        edited[:, s] = (edited[:, s] + 1) % vocab_size
        diff = _row_view(fn(edited).to(torch.float64) - base, out_row_dim)
        mag[:, s] = diff.pow(2).sum(dim=1).sqrt()
    return _finish(mag, "token", rows, 0.0)  # any change: depends


def map_table(m: CheckedMap | DependencyMap, labels: Sequence[str],
              out_labels: Sequence[str] | None = None, corner: str = "out \\ in",
              caption: str | None = None) -> str:
    """A dependency map as a small HTML table: ``●`` where the output row needs the input row;
    ``labels`` name the input rows, and the output rows unless ``out_labels`` is given.

    >>> m = jacobian_map(lambda x: x.cumsum(0), torch.ones(2, 1, dtype=torch.float64))
    >>> html_out = map_table(m, "AB")
    >>> html_out.count("●"), html_out.count("·")
    (3, 1)
    """
    dm = m.jacobian if isinstance(m, CheckedMap) else m
    outs = list(out_labels) if out_labels is not None else [labels[t] for t in dm.out_rows]
    dm = dm.relabel(list(labels), outs)
    rows = [[outs[t]] + ["●" if bool(dm.depends[t, s]) else "·" for s in range(dm.shape[1])]
            for t in range(dm.shape[0])]
    return html_table([corner, *labels], rows, caption=caption, css_class="kvdoc-map")


# --- what a hybrid cache stores, and what a replaced token changes ---------------------------

def stored(cache: KVCache) -> dict[str, torch.Tensor]:
    """Every tensor ``cache`` holds, by name: a K/V layer's rows one by one (``[B, H, w_K + w_V]``
    each), a state layer's named tensors whole."""
    out = {}
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, StateLayer):
            out.update({f"h{i} {name}": t for name, t in read_state(cache, i).items()})
            continue
        k, v = cache.layer(i)  # [B, H, T, D]
        for t in cache.held(i):
            out[f"h{i} K/V {t}"] = torch.cat([k[:, :, t], v[:, :, t]], dim=-1)
    return out


def changed_by_token(model: torch.nn.Module, ids: torch.Tensor
                     ) -> tuple[list[str], torch.Tensor]:
    """The names of the stored tensors after a prefill of ``ids`` (``[1, T]``), and a bool
    ``[tensors, T]``: True where replacing token ``j`` (by the next id) changes that tensor."""
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 1:
        raise ValueError(f"need one prompt of at least one token, [1, T]; got {tuple(ids.shape)}")
    with torch.no_grad():
        base = stored(model(ids, model.new_cache(1))[1])
        columns = []
        for j in range(ids.shape[1]):
            other = ids.clone()
            other[0, j] = (other[0, j] + 1) % model.config.vocab_size
            moved = stored(model(other, model.new_cache(1))[1])
            columns.append([not torch.equal(moved[n], t) for n, t in base.items()])
    return list(base), torch.tensor(columns).T
