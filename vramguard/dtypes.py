"""The one table of element types: vramguard's short name, torch's name, safetensors' name and bytes per element.

Every other module reads element sizes and dtype names from here (no torch: this table is what the planner uses
where torch is not imported). Sources: ``torch.dtype.itemsize`` for the sizes (tests/test_one_rule.py checks each
row against torch), safetensors' ``Dtype`` enum (``safetensors/src/tensor.rs``) for the header names.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    """One element type: ``name`` is vramguard's (``bf16``; integers keep torch's name), ``torch_name`` the
    attribute of ``torch`` (``torch.bfloat16``), ``safetensors`` the header's ``dtype`` (``BF16``), ``bytes`` the
    element size in bytes; ``stored_float`` marks the floats a checkpoint holds unquantized (16 bits or more)."""

    name: str
    torch_name: str
    safetensors: str
    bytes: int
    stored_float: bool = False


TABLE = (
    DType("fp64", "float64", "F64", 8, True),
    DType("fp32", "float32", "F32", 4, True),
    DType("fp16", "float16", "F16", 2, True),
    DType("bf16", "bfloat16", "BF16", 2, True),
    DType("fp8_e4m3", "float8_e4m3fn", "F8_E4M3", 1),
    DType("fp8_e5m2", "float8_e5m2", "F8_E5M2", 1),
    DType("fp8_e8m0", "float8_e8m0fnu", "F8_E8M0", 1),
    DType("int64", "int64", "I64", 8),
    DType("int32", "int32", "I32", 4),
    DType("int16", "int16", "I16", 2),
    DType("int8", "int8", "I8", 1),
    DType("uint64", "uint64", "U64", 8),
    DType("uint32", "uint32", "U32", 4),
    DType("uint16", "uint16", "U16", 2),
    DType("uint8", "uint8", "U8", 1),
    DType("bool", "bool", "BOOL", 1),
)

BYTES = {d.name: d.bytes for d in TABLE}  # bytes per element by vramguard's name
TORCH_BYTES = {d.torch_name: d.bytes for d in TABLE}  # bytes per element by torch's name
SAFETENSORS_BYTES = {d.safetensors: d.bytes for d in TABLE}  # bytes per element by safetensors' name
TORCH_NAMES = {d.name: d.torch_name for d in TABLE}  # vramguard's name -> torch.<name>
SAFETENSORS_FLOATS = {d.safetensors: d.name for d in TABLE if d.stored_float}  # "BF16" -> "bf16"
