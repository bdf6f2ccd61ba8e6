"""Tensors to bytes and back, with an allow-list of dtypes.

Bytes travel as raw little-endian memory of the tensor, with no numpy dtype
round trip, so every torch dtype works (bfloat16 and the float8 types included).
A dtype name read from the server is only ever looked up in ``DTYPES``: nothing
read from the server is imported, evaluated or unpickled.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import torch

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("tdstore stores raw little-endian tensor bytes; big-endian hosts are unsupported")

_DTYPE_NAMES = [
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex32",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
]

#: The only dtypes a store accepts, by name.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _DTYPE_NAMES if isinstance(getattr(torch, name, None), torch.dtype)
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The allow-listed name of ``dtype``; raises ``TypeError`` for anything else."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot be stored; supported dtypes: {sorted(DTYPES)}") from None


def dtype_from_name(name: str) -> torch.dtype:
    """Look a dtype name read from the server up in the allow-list."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} in the store metadata (not one of tdstore's dtypes)") from None


def itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def nbytes(shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


#: dtypes whose tensors ``.numpy()`` can view directly (bfloat16, float8, complex32 and wide uints go through uint8).
NUMPY_NATIVE = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    }
)


def to_bytes(tensor: torch.Tensor) -> memoryview:
    """Raw bytes of ``tensor`` (moved to CPU, made contiguous), without a copy when possible.

    redis-py sends a ``memoryview`` as it is, so the bytes are copied only once,
    into the socket buffer.
    """
    if tensor.is_cpu and not tensor.requires_grad and tensor.dtype in NUMPY_NATIVE:
        # the common case: numpy sees the tensor's own memory, no torch ops needed (numpy()
        # refuses a tensor with its conjugate or negative bit set: the general path resolves it).
        # The fewest checks: this runs once per leaf of every element write.
        try:
            a = tensor.numpy()
        except RuntimeError:
            pass
        else:
            if a.flags.c_contiguous:
                return a.data.cast("B") if a.size else memoryview(b"")
    t = tensor.detach().resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return t.view(torch.uint8).numpy().data.cast("B")


def from_bytes(data: bytes | bytearray | memoryview, dtype: torch.dtype, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
    """A new writable tensor of ``dtype`` and ``shape`` holding ``data``.

    The bytes are copied once, into a ``bytearray`` that the tensor then owns
    (``torch.frombuffer`` on the reply itself would share a read-only buffer and warn).
    """
    expected = nbytes(shape, dtype)
    if len(data) != expected:
        raise ValueError(f"expected {expected} bytes for {dtype_name(dtype)}{list(shape)}, got {len(data)}")
    if not expected:
        return torch.empty(tuple(shape), dtype=dtype)
    # a bytearray is taken over as it is (callers hand over a buffer they built); anything else is copied once
    owned = data if isinstance(data, bytearray) else bytearray(data)
    flat = torch.frombuffer(owned, dtype=dtype) if dtype in NUMPY_NATIVE else torch.frombuffer(owned, dtype=torch.uint8).view(dtype)
    return flat if len(shape) == 1 else flat.reshape(tuple(shape))


def from_pieces(pieces: list[bytes], dtype: torch.dtype, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
    """Like :func:`from_bytes` for data that arrives as several pieces, copied straight into place."""
    if len(pieces) == 1:
        return from_bytes(pieces[0], dtype, shape)
    expected = nbytes(shape, dtype)
    out = torch.empty(expected, dtype=torch.uint8)
    view = out.numpy()
    pos = 0
    for piece in pieces:
        n = len(piece)
        if pos + n > expected:
            break
        view[pos : pos + n] = np.frombuffer(piece, dtype=np.uint8)
        pos += n
    if pos != expected or sum(len(p) for p in pieces) != expected:
        raise ValueError(f"expected {expected} bytes for {dtype_name(dtype)}{list(shape)}, got {sum(len(p) for p in pieces)}")
    return out.view(dtype).reshape(tuple(shape))


#: The unsigned dtypes torch's ``index_select`` does not implement (2.13), and the signed dtype of their size.
_SAME_SIZE_SIGNED = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


def index_select(tensor: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """``tensor.index_select(dim, index)`` for every dtype a store holds: uint16, uint32 and uint64 are
    selected as the signed dtype of their size (the same bytes), where torch would raise ``NotImplementedError``."""
    signed = _SAME_SIZE_SIGNED.get(tensor.dtype)
    if signed is None:
        return tensor.index_select(dim, index)
    return tensor.view(signed).index_select(dim, index).view(tensor.dtype)


def pack_i64(values: list[int] | np.ndarray) -> bytes:
    return np.asarray(values, dtype="<i8").tobytes()


def unpack_i64(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i8")
