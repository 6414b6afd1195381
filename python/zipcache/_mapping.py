"""numpy arrays over the read-only mappings a session handle holds, without copies.

One holder class for every array this package builds over shared memory:
the fp16 views (client.py) and the pool's payload bytes and residual rows
(reader.py). The holder keeps the session handle, so the mapping outlives
no array of it.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from . import _lib
from .errors import error_from_code


class _ViewHolder:
    """The base object of mapped arrays: exposes the mapping to numpy, read-only.

    numpy builds an array from ``__array_interface__`` without copying and
    keeps this object as the array's base; the ``(address, True)`` data
    tuple makes the array read-only, and since this object offers no
    writable buffer numpy also refuses ``arr.flags.writeable = True``.
    """

    __slots__ = ("__array_interface__", "session", "__weakref__")

    def __init__(self, address: int, shape: tuple[int, ...], strides: tuple[int, ...],
                 session: Any, typestr: str = "<f2") -> None:
        self.__array_interface__ = {
            "version": 3,
            "shape": shape,
            "typestr": typestr,
            "data": (address, True),
            "strides": strides,
        }
        self.session = session


def _address(pointer: Any, what: str) -> int:
    address = ctypes.cast(pointer, ctypes.c_void_p).value
    if not address:
        raise error_from_code(_lib.ZC_EPROTOCOL, f"the daemon's {what} has no address", what)
    return address


def _mapped_array(pointer: Any, shape: tuple[int, int, int, int], strides: _lib.zc_strides,
                  session: Any, what: str = "view") -> np.ndarray:
    """A read-only float16 [B, H, S, D] array at pointer with element strides."""
    address = _address(pointer, what)
    itemsize = 2  # fp16
    byte_strides = (strides.batch * itemsize, strides.head * itemsize, strides.token * itemsize,
                    itemsize)
    holder = _ViewHolder(address, shape, byte_strides, session)
    session.holders.add(holder)
    array = np.asarray(holder)
    assert not array.flags.writeable and array.dtype == np.float16
    return array


def _mapped_bytes(pointer: Any, size: int, session: Any, what: str) -> np.ndarray:
    """A read-only uint8 array over size bytes at pointer."""
    address = _address(pointer, what)
    holder = _ViewHolder(address, (size,), (1,), session, "|u1")
    session.holders.add(holder)
    array = np.asarray(holder)
    assert not array.flags.writeable and array.dtype == np.uint8
    return array
