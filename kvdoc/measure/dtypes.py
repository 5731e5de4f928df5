"""Element types by name: the dtype names the measurements and ``--dtype`` accept, and the bytes
``s`` each element takes, known without importing torch.

>>> dtype_name("half"), element_size("bf16")
('float16', 2)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: Names accepted for ``dtype`` arguments and ``--dtype`` (case-insensitive), and the name of
#: the torch dtype each stands for (``torch.<name>``).
DTYPES: dict[str, str] = {
    "float64": "float64", "fp64": "float64", "double": "float64",
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2",
    "fp8": "float8_e4m3fn",
    "int8": "int8",
}

#: ``s`` of each dtype in :data:`DTYPES`, as torch stores it (tests/test_memory.py compares
#: every entry with torch's own ``element_size``): known without importing torch.
ELEMENT_BYTES: dict[str, int] = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
                                 "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1}


def _is_torch_dtype(dtype: object) -> bool:
    return type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype"


def dtype_name(dtype: str | torch.dtype) -> str:
    """The canonical name of a dtype, e.g. ``"float16"`` for ``"fp16"``.

    Raises:
        ValueError: an unknown name.

    >>> dtype_name("FP16"), dtype_name("bf16")
    ('float16', 'bfloat16')
    """
    if _is_torch_dtype(dtype):
        return str(dtype).removeprefix("torch.")
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")


def element_size(dtype: str | torch.dtype) -> int:
    """``s``: bytes per element of ``dtype``, as torch stores it.

    >>> import torch
    >>> element_size("float16"), element_size(torch.float32)
    (2, 4)
    """
    if _is_torch_dtype(dtype):
        return dtype.itemsize
    return ELEMENT_BYTES[dtype_name(dtype)]
