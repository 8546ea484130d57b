"""Row record layout: the weight vector plus optional per-row fields, packed into fixed bytes.

Optimizer moments and step counters live in the same record as the weights, so one flush writes
a row and its state together: they can never come from different moments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InvalidArgumentError, InvalidTypeError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int32": torch.int32,
    "int64": torch.int64,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def dtype_name(dtype: torch.dtype, arg: str = "dtype") -> str:
    if dtype not in DTYPE_NAMES:
        raise InvalidTypeError(f"{arg} must be one of {sorted(DTYPES)}; got {dtype}")
    return DTYPE_NAMES[dtype]


@dataclass(frozen=True)
class Field:
    name: str
    dtype: torch.dtype
    cols: int
    offset: int  # byte offset inside the record
    fill: float = 0.0  # value of a row never written (weights use the store's init instead)

    @property
    def nbytes(self) -> int:
        return self.cols * self.dtype.itemsize


class Schema:
    """Named fields at fixed byte offsets in a record of ``row_bytes`` bytes."""

    def __init__(self, dim: int, dtype: torch.dtype, extra: dict | None = None) -> None:
        if dtype not in WEIGHT_DTYPES:
            raise InvalidTypeError(
                f"dtype must be a floating dtype {[DTYPE_NAMES[d] for d in WEIGHT_DTYPES]}; got {dtype}"
            )
        fields = [Field("weight", dtype, dim, 0)]
        offset = dim * dtype.itemsize
        for name, spec in (extra or {}).items():
            if not isinstance(name, str) or not name.isidentifier() or name == "weight":
                raise InvalidArgumentError(f"fields keys must be identifiers other than 'weight'; got {name!r}")
            if not isinstance(spec, (tuple, list)) or len(spec) not in (2, 3):
                raise InvalidArgumentError(
                    f"fields[{name!r}] must be (dtype, cols) or (dtype, cols, fill); got {spec!r}"
                )
            fdtype, cols = spec[0], int(spec[1])
            fill = float(spec[2]) if len(spec) == 3 else 0.0
            dtype_name(fdtype, f"fields[{name!r}] dtype")
            if cols < 1:
                raise InvalidArgumentError(f"fields[{name!r}] cols must be >= 1; got {cols}")
            align = fdtype.itemsize
            offset = (offset + align - 1) // align * align
            fields.append(Field(name, fdtype, cols, offset, fill))
            offset += cols * fdtype.itemsize
        self.row_bytes = (offset + 7) // 8 * 8 if len(fields) > 1 else offset
        self.fields = {f.name: f for f in fields}
        self.dim = dim
        self.dtype = dtype

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.fields)

    def view(self, records: torch.Tensor, name: str) -> torch.Tensor:
        """Typed (n, cols) view of one field inside uint8 records of shape (n, row_bytes)."""
        f = self.fields[name]
        if len(self.fields) == 1:
            return records.view(f.dtype)
        return records[:, f.offset : f.offset + f.nbytes].view(f.dtype)

    def to_json(self) -> dict:
        return {
            "dim": self.dim,
            "dtype": DTYPE_NAMES[self.dtype],
            "extra": {n: [DTYPE_NAMES[f.dtype], f.cols, f.fill] for n, f in self.fields.items() if n != "weight"},
        }

    @classmethod
    def from_json(cls, obj: dict) -> Schema:
        extra = {n: (DTYPES[d], c, fill) for n, (d, c, fill) in obj["extra"].items()}
        return cls(obj["dim"], DTYPES[obj["dtype"]], extra)
