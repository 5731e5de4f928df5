"""The 2-d worked example: one head, four tokens, the naive and the cached path side by side,
and each step typeset as LaTeX from its values.

One head, ``d_head = 2``, ``W_q = W_k = W_v = I`` (so ``Q = K = V = x``). At decode step ``t``
the *naive* path recomputes ``Q, K, V`` for all ``T = t + 1`` tokens and keeps the last output
row; the *cached* path projects the one new token and reads ``K_full, V_full`` from the cache:
the ``[B, H_kv, T, D_h]`` layout of :mod:`kvdoc.core.cache` with ``B = H_kv = 1``, ``D_h = 2``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvdoc.core.cache import offset_causal_mask

WORKED_INPUTS: tuple[tuple[float, float], ...] = ((1.0, 2.0), (3.0, 1.0), (2.0, 3.0), (4.0, 1.0))
"""``x0 = [1, 2]``, ``x1 = [3, 1]``, ``x2 = [2, 3]``, ``x3 = [4, 1]``: the source's four tokens."""

SOURCE_FIGURES: dict[int, dict[str, tuple[float, ...]]] = {
    0: {"scores": (3.536,), "weights": (1.000,), "output": (1.000, 2.000)},
    1: {"scores": (3.536, 7.071), "weights": (0.030, 0.970), "output": (2.940, 1.030)},
    2: {"scores": (5.657, 6.364, 9.192), "weights": (0.007, 0.028, 0.965),
        "output": (2.014, 2.930)},
    3: {"scores": (4.243, 9.192, 7.778, 12.021), "weights": (0.000, 0.007, 0.001, 0.991),
        "output": (3.980, 1.010)},
}
"""The source's hand-computed figures for the last row at each step (3 decimals): data to
compare with, not authority (:func:`compare_with_source` says where they are wrong)."""


@dataclass(frozen=True)
class NaivePath:
    """The naive path at one step: ``Q, K, V`` ``[T, 2]``; ``scores``, ``masked`` (``-inf``
    above the diagonal), ``weights`` ``[T, T]``; ``output`` ``[T, 2]``."""

    Q: torch.Tensor
    K: torch.Tensor
    V: torch.Tensor
    scores: torch.Tensor
    masked: torch.Tensor
    weights: torch.Tensor
    output: torch.Tensor

    @property
    def last(self) -> torch.Tensor:
        """``[2]``: the row the next-token prediction uses, ``output[-1]``."""
        return self.output[-1]


@dataclass(frozen=True)
class CachedPath:
    """The cached path at one step: ``q, k, v`` ``[1, 2]`` of the new token only; ``K_full,
    V_full`` ``[T, 2]``; ``scores``, ``weights`` ``[1, T]`` (no mask); ``output`` ``[2]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    K_full: torch.Tensor
    V_full: torch.Tensor
    scores: torch.Tensor
    weights: torch.Tensor
    output: torch.Tensor


@dataclass(frozen=True)
class WorkedStep:
    """Both paths at decode step ``step`` (``step + 1`` tokens seen)."""

    step: int
    naive: NaivePath
    cached: CachedPath

    @property
    def max_abs_diff(self) -> float:
        """Largest ``|naive.last - cached.output|`` over the two coordinates."""
        return float((self.naive.last - self.cached.output).abs().max())


def _projections(w: Sequence[torch.Tensor] | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if w is None:
        eye = torch.eye(2, dtype=torch.float64)
        return eye, eye, eye
    if len(w) != 3 or any(tuple(m.shape) != (2, 2) for m in w):
        raise ValueError("projections must be three [2, 2] matrices (W_q, W_k, W_v)")
    w_q, w_k, w_v = (m.to(torch.float64) for m in w)
    return w_q, w_k, w_v


def _as_inputs(inputs: Sequence[Sequence[float]] | torch.Tensor) -> torch.Tensor:
    x = torch.as_tensor(inputs, dtype=torch.float64)
    if x.ndim != 2 or x.shape[1] != 2 or x.shape[0] < 1:
        raise ValueError(f"inputs must be a non-empty [T, 2] array, got shape {tuple(x.shape)}")
    return x


def naive_step(x: torch.Tensor, projections: Sequence[torch.Tensor] | None = None) -> NaivePath:
    """Recompute attention over every row of ``x`` (``[T, 2]``) with a causal mask.

    ``projections``: ``(W_q, W_k, W_v)``, each ``[2, 2]`` acting as ``x @ W``; identity if None.

    >>> p = naive_step(torch.tensor(WORKED_INPUTS[:2], dtype=torch.float64))
    >>> p.scores.shape, p.weights[0].tolist()
    (torch.Size([2, 2]), [1.0, 0.0])
    """
    x = _as_inputs(x)
    w_q, w_k, w_v = _projections(projections)
    Q, K, V = x @ w_q, x @ w_k, x @ w_v  # [T, 2] each
    T = x.shape[0]
    scores = Q @ K.T / math.sqrt(2)  # [T, T]
    allowed = offset_causal_mask(0, T)  # no cache: the ordinary lower triangle
    masked = scores.masked_fill(~allowed, float("-inf"))
    weights = masked.softmax(dim=-1)
    return NaivePath(Q, K, V, scores, masked, weights, weights @ V)


def cached_step(x_new: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                projections: Sequence[torch.Tensor] | None = None) -> CachedPath:
    """Project the new token ``x_new`` (``[2]``), append its K/V to ``cache_k, cache_v``
    (``[P, 2]``, ``P`` may be 0) and attend with its query alone.

    >>> empty = torch.zeros(0, 2, dtype=torch.float64)
    >>> cached_step(torch.tensor([1.0, 2.0], dtype=torch.float64), empty, empty).output.tolist()
    [1.0, 2.0]
    """
    w_q, w_k, w_v = _projections(projections)
    x_new = torch.as_tensor(x_new, dtype=torch.float64).reshape(1, 2)
    if cache_k.shape != cache_v.shape or cache_k.ndim != 2 or cache_k.shape[1] != 2:
        raise ValueError("cache_k and cache_v must both be [P, 2]")
    q, k, v = x_new @ w_q, x_new @ w_k, x_new @ w_v  # [1, 2] each: the only new projections
    K_full = torch.cat([cache_k, k])  # [P + 1, 2]
    V_full = torch.cat([cache_v, v])
    scores = q @ K_full.T / math.sqrt(2)  # [1, P + 1]
    weights = scores.softmax(dim=-1)
    return CachedPath(q, k, v, K_full, V_full, scores, weights, (weights @ V_full)[0])


def worked_example(inputs: Sequence[Sequence[float]] | torch.Tensor = WORKED_INPUTS,
                   projections: Sequence[torch.Tensor] | None = None) -> list[WorkedStep]:
    """Both paths for every decode step of ``inputs`` (``[T, 2]``), the cached one carrying
    its cache from step to step.

    >>> steps = worked_example()
    >>> [s.naive.Q.shape[0] for s in steps], max(s.max_abs_diff for s in steps) < 1e-12
    ([1, 2, 3, 4], True)
    """
    x = _as_inputs(inputs)
    cache_k = cache_v = torch.zeros(0, 2, dtype=torch.float64)
    steps = []
    for t in range(x.shape[0]):
        naive = naive_step(x[: t + 1], projections)
        cached = cached_step(x[t], cache_k, cache_v, projections)
        cache_k, cache_v = cached.K_full, cached.V_full
        steps.append(WorkedStep(t, naive, cached))
    return steps


@dataclass(frozen=True)
class SourceComparison:
    """The source's figures for one quantity (``"scores"``, ``"weights"`` or ``"output"`` of
    the last row) at one step beside the computed ones; ``agrees``: each is the computed value
    to 3 decimals; ``from_source_inputs``: what the source's own previous figure implies."""

    step: int
    quantity: str
    source: tuple[float, ...]
    computed: tuple[float, ...]
    max_abs_diff: float
    agrees: bool
    from_source_inputs: tuple[float, ...] | None


def compare_with_source(steps: Sequence[WorkedStep],
                        figures: dict[int, dict[str, tuple[float, ...]]] = SOURCE_FIGURES
                        ) -> list[SourceComparison]:
    """One :class:`SourceComparison` per step and quantity of ``figures``.

    >>> rows = compare_with_source(worked_example())
    >>> [(r.step, r.quantity) for r in rows if not r.agrees]  # doctest: +ELLIPSIS
    [(1, 'weights'), ...]
    """
    out = []
    for s in steps:
        if s.step not in figures:
            continue
        fig = figures[s.step]
        computed = {"scores": s.cached.scores[0], "weights": s.cached.weights[0],
                    "output": s.cached.output}
        for name in ("scores", "weights", "output"):
            src = torch.tensor(fig[name], dtype=torch.float64)
            comp = computed[name]
            if src.shape != comp.shape:
                raise ValueError(f"step {s.step} {name}: source has {src.numel()} values, "
                                 f"computed {comp.numel()}")
            diff = float((src - comp).abs().max())
            implied = None
            if name == "weights":
                scores = torch.tensor(fig["scores"], dtype=torch.float64)
                implied = tuple(scores.softmax(-1).tolist())
            elif name == "output":
                weights = torch.tensor(fig["weights"], dtype=torch.float64)
                implied = tuple((weights @ s.cached.V_full).tolist())
            out.append(SourceComparison(s.step, name, tuple(src.tolist()), tuple(comp.tolist()),
                                        diff, diff <= 0.0005 + 1e-9, implied))
    return out


def _fmt(v: float, decimals: int) -> str:
    if v == float("-inf"):
        return r"-\infty"
    s = f"{v:.{decimals}f}"
    return "0." + "0" * decimals if s == "-0." + "0" * decimals else s


def latex_matrix(t: torch.Tensor | Sequence, decimals: int = 3) -> str:
    """A ``bmatrix`` of ``t`` (1-d or 2-d) with ``decimals`` places; ``-inf`` becomes ``-\\infty``.

    >>> latex_matrix(torch.tensor([[1.0, float("-inf")]]))
    '\\\\begin{bmatrix}1.000 & -\\\\infty\\\\end{bmatrix}'
    """
    t = torch.as_tensor(t, dtype=torch.float64)
    if t.ndim == 1:
        t = t[None, :]
    if t.ndim != 2:
        raise ValueError("latex_matrix takes a 1-d or 2-d array")
    rows = [" & ".join(_fmt(float(v), decimals) for v in row) for row in t]
    return r"\begin{bmatrix}" + r" \\ ".join(rows) + r"\end{bmatrix}"


def _equal_or_each(names: Sequence[str], values: Sequence[torch.Tensor]) -> str:
    """``Q = K = V &= [...]`` when the tensors are equal (W_q = W_k = W_v), else one each."""
    if all(torch.equal(values[0], v) for v in values[1:]):
        return rf"{' = '.join(names)} &= {latex_matrix(values[0])} \\"
    shown = [f"{n} = {latex_matrix(v)}" for n, v in zip(names, values, strict=True)]
    shown[0] = shown[0].replace(" = ", " &= ", 1)  # aligned on the first
    return r",\; ".join(shown) + r" \\"


def _aligned(*rows: str) -> str:
    return "\n".join([r"\begin{aligned}", *rows, r"\end{aligned}"])


def naive_latex(s: WorkedStep) -> str:
    """The naive path of one step as an ``aligned`` LaTeX block.

    >>> print(naive_latex(worked_example()[0]).splitlines()[1])
    Q = K = V &= \\begin{bmatrix}1.000 & 2.000\\end{bmatrix} \\\\
    """
    n = s.naive
    m = latex_matrix
    return _aligned(
        _equal_or_each("QKV", (n.Q, n.K, n.V)),
        rf"\text{{scores}} = QK^\top/\sqrt{{2}} &= {m(n.scores)} \\",
        rf"\text{{masked}} &= {m(n.masked)} \\",
        rf"\text{{weights}} = \operatorname{{softmax}}(\text{{masked}}) &= {m(n.weights)} \\",
        rf"\text{{output}} = \text{{weights}}\, V &= {m(n.output)} \\",
        rf"\text{{output}}[-1] &= {m(n.last)}",
    )


def cached_latex(s: WorkedStep) -> str:
    """The cached path of one step as an ``aligned`` LaTeX block.

    >>> print(cached_latex(worked_example()[1]).splitlines()[1])
    q = k = v &= \\begin{bmatrix}3.000 & 1.000\\end{bmatrix} \\\\
    """
    c = s.cached
    m = latex_matrix
    return _aligned(
        _equal_or_each("qkv", (c.q, c.k, c.v)),
        _equal_or_each((r"K_\text{full}", r"V_\text{full}"), (c.K_full, c.V_full)),
        rf"\text{{scores}} = q K_\text{{full}}^\top/\sqrt{{2}} &= {m(c.scores)} \\",
        rf"\text{{weights}} = \operatorname{{softmax}}(\text{{scores}}) &= {m(c.weights)} \\",
        rf"\text{{output}} = \text{{weights}}\, V_\text{{full}} &= {m(c.output)}",
    )
