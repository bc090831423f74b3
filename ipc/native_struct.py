"""Argument structs the host passes to its own C code (ipc/native.py builds it), declared once
with ipc/layout.py's Struct and Field, as the ring contract is.

The declaration gives both sides: `host_c_text()` is the C++ struct, each size and offset
static_asserted by the host compiler, and `struct_record()` the numpy record the Python side fills
by field name and hands over by address. Beside layout's scalar kinds, a field may be a Pointer.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from ringleader.ipc.layout import Field, Struct

POINTER_SIZE = ctypes.sizeof(ctypes.c_void_p)


@dataclass(frozen=True)
class Pointer(Field):
    """A host pointer to `kind` (one of layout's scalar kinds); the record holds its address."""

    const: bool = False  # the C side only reads through it

    @property
    def item_size(self) -> int:
        return POINTER_SIZE

    @property
    def item_align(self) -> int:
        return POINTER_SIZE

    def numpy_base(self) -> np.dtype:
        return np.dtype(np.uintp)

    @property
    def c_type(self) -> str:
        return ("const " if self.const else "") + super().c_type + "*"


def host_c_text(*structs: Struct) -> str:
    """The structs' C++ text for the host compiler, with layout's static_asserts on every size and
    offset, so a build whose struct disagrees with the declaration fails to compile."""
    return "\n".join(
        [
            "#include <stddef.h>",
            "#include <stdint.h>",
            "#ifndef RL_ASSERT_OFFSET",  # the same check as c_header's, where both are included
            '#define RL_ASSERT_OFFSET(t, m, off) static_assert(offsetof(t, m) == (off), #t "." #m)',
            "#endif",
            *(s.c_text() for s in structs),
            "",
        ]
    )


def struct_record(struct: Struct, **fields: int | float) -> np.ndarray:
    """A zeroed 0-d record of `struct` with `fields` set by name (an unknown name raises); pass
    it to C as `record.ctypes.data`, keeping the record alive as long as C may read it."""
    record = np.zeros((), struct.numpy_dtype())
    for name, value in fields.items():
        record[name] = value
    if record.ctypes.data % struct.align:  # numpy's allocator aligns to 16; a check, not a hope
        raise ValueError(f"{struct.name} record is not {struct.align}-byte aligned")
    return record
