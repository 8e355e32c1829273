"""String tensors: Triton's BYTES as the text a framework reads, and returned text back to BYTES.

Triton's python backend hands a BYTES tensor over as a numpy object array of ``bytes``. A framework that
reads text does not decode it: onnxruntime's Python API turns each ``bytes`` element into its ``str()``
(``b"monday"`` becomes ``"b'monday'"``), silently. On the way out the stub sends an element as it is only
when it is exactly ``bytes``; anything else goes as ``str(element)`` in UTF-8, so a ``numpy.bytes_`` or a
``None`` would reach the client as its repr. Both functions return their argument itself when it is already
what the other side wants. Standard library + numpy only, Python 3.10 syntax (python_backend rule).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import BadModelOutput, InvalidInput


def _position(index: int, shape: tuple[int, ...]) -> str:
    return str([int(i) for i in np.unravel_index(index, shape)]) if len(shape) > 1 else f"[{index}]"


def decode_text(array: np.ndarray, name: str) -> np.ndarray:
    """A BYTES input as UTF-8 text: an object array of ``str``, same shape. InvalidInput names the input and
    the first element that is not UTF-8."""
    items = array.ravel().tolist()
    if all(type(item) is str for item in items):
        return array if array.dtype == object else _objects(items, array.shape)
    try:
        texts = [item if isinstance(item, str) else item.decode("utf-8") for item in items]
    except (UnicodeDecodeError, AttributeError):
        raise InvalidInput(_not_text(items, array.shape, name)) from None
    return _objects(texts, array.shape)


def _not_text(items: list[Any], shape: tuple[int, ...], name: str) -> str:
    for index, item in enumerate(items):
        if isinstance(item, str):
            continue
        try:
            item.decode("utf-8")
        except UnicodeDecodeError as e:
            what = f"is not UTF-8 ({e.reason} at byte {e.start})"
        except AttributeError:
            what = f"is a {type(item).__name__}, not bytes"
        else:
            continue
        return (
            f"input '{name}' element {_position(index, shape)} {what}; the model reads this input as text "
            "(ONNX tensor(string)): send UTF-8 encoded strings"
        )
    return f"input '{name}' is not UTF-8 text; send UTF-8 encoded strings"  # not reached: one element failed


def encode_text(array: np.ndarray, what: str) -> np.ndarray:
    """An output declared BYTES as the stub must get it: an object array whose elements are exactly ``bytes``
    (``str`` encoded as UTF-8, ``numpy.bytes_`` and other bytes-like values as plain bytes), same shape.
    BadModelOutput names the output and the first element that is neither text nor bytes."""
    items = array.ravel().tolist()
    if all(type(item) is bytes for item in items):
        return array if array.dtype == object else _objects(items, array.shape)
    try:
        data = [item if type(item) is bytes else _as_bytes(item) for item in items]
    except (TypeError, UnicodeEncodeError):
        raise BadModelOutput(_not_bytes(items, array.shape, what)) from None
    return _objects(data, array.shape)


def _as_bytes(item: Any) -> bytes:
    if isinstance(item, str):
        return item.encode("utf-8")
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item)
    raise TypeError(type(item).__name__)


def _not_bytes(items: list[Any], shape: tuple[int, ...], what: str) -> str:
    for index, item in enumerate(items):
        try:
            _as_bytes(item)
        except UnicodeEncodeError as e:
            problem = f"is a str that UTF-8 cannot encode ({e.reason})"
        except TypeError:
            problem = f"is a {type(item).__name__}"
        else:
            continue
        return (
            f"{what} element {_position(index, shape)} {problem}, but the output is declared BYTES; return bytes "
            "or str elements (str is sent as UTF-8)"
        )
    return f"{what} is declared BYTES; return bytes or str elements"  # not reached: one element failed


def _objects(items: list[Any], shape: tuple[int, ...]) -> np.ndarray:
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out.reshape(shape)
