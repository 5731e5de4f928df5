"""LaTeX generated from values: matrices (:func:`latex_matrix`) and the worked example's naive
and cached paths, one step each, as ``aligned`` blocks (:func:`naive_latex`,
:func:`cached_latex`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .worked import WorkedStep


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


def _equal_or_each(names: Sequence[str], values: Sequence[torch.Tensor], decimals: int) -> str:
    """``Q = K = V &= [...]`` when the tensors are equal (W_q = W_k = W_v), else one each."""
    if all(torch.equal(values[0], v) for v in values[1:]):
        return rf"{' = '.join(names)} &= {latex_matrix(values[0], decimals)} \\"
    shown = [f"{n} = {latex_matrix(v, decimals)}" for n, v in zip(names, values, strict=True)]
    shown[0] = shown[0].replace(" = ", " &= ", 1)  # aligned on the first
    return r",\; ".join(shown) + r" \\"


def _aligned(*rows: str) -> str:
    return "\n".join([r"\begin{aligned}", *rows, r"\end{aligned}"])


def naive_latex(s: WorkedStep, decimals: int = 3) -> str:
    """The naive path of one step as an ``aligned`` LaTeX block generated from the values.

    >>> from kvdoc.teach.worked import worked_example
    >>> print(naive_latex(worked_example()[0]).splitlines()[1])
    Q = K = V &= \\begin{bmatrix}1.000 & 2.000\\end{bmatrix} \\\\
    """
    n = s.naive
    m = lambda t: latex_matrix(t, decimals)  # noqa: E731
    return _aligned(
        _equal_or_each("QKV", (n.Q, n.K, n.V), decimals),
        rf"\text{{scores}} = QK^\top/\sqrt{{2}} &= {m(n.scores)} \\",
        rf"\text{{masked}} &= {m(n.masked)} \\",
        rf"\text{{weights}} = \operatorname{{softmax}}(\text{{masked}}) &= {m(n.weights)} \\",
        rf"\text{{output}} = \text{{weights}}\, V &= {m(n.output)} \\",
        rf"\text{{output}}[-1] &= {m(n.last)}",
    )


def cached_latex(s: WorkedStep, decimals: int = 3) -> str:
    """The cached path of one step as an ``aligned`` LaTeX block generated from the values.

    >>> from kvdoc.teach.worked import worked_example
    >>> print(cached_latex(worked_example()[1]).splitlines()[1])
    q = k = v &= \\begin{bmatrix}3.000 & 1.000\\end{bmatrix} \\\\
    """
    c = s.cached
    m = lambda t: latex_matrix(t, decimals)  # noqa: E731
    return _aligned(
        _equal_or_each("qkv", (c.q, c.k, c.v), decimals),
        _equal_or_each((r"K_\text{full}", r"V_\text{full}"), (c.K_full, c.V_full), decimals),
        rf"\text{{scores}} = q K_\text{{full}}^\top/\sqrt{{2}} &= {m(c.scores)} \\",
        rf"\text{{weights}} = \operatorname{{softmax}}(\text{{scores}}) &= {m(c.weights)} \\",
        rf"\text{{output}} = \text{{weights}}\, V_\text{{full}} &= {m(c.output)}",
    )
