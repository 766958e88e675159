"""The key-value metadata of a GGUF file, read without its tensors (stdlib only).

A GGUF file is a header (``GGUF``, version, tensor count, key-value count), the key-value
pairs, the tensor infos, then the tensor data. The gateway needs only the pairs (the
tokenizer's vocabulary, merges, token types, special ids and ``tokenizer.chat_template``), so
this reads them from a memory map and stops there. ``gguf.GGUFReader`` parses every field
into NumPy views and every tensor info too: 28 s for SmolLM2-135M's 98 MB file on the loaded
2-core machine where this takes well under a second (docs/gateway.md, "Model tokenizer").

Format: llama.cpp's ``ggml/include/gguf.h`` / ``docs/gguf.md`` (versions 2 and 3, little-endian).
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

# type id -> struct format of one scalar
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class GgufError(ValueError):
    """Not a GGUF file, or a truncated or malformed one (the message says where)."""


class _Cursor:
    def __init__(self, buf, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise GgufError(f"{self.path}: truncated at byte {self.pos} (wanted {size} more)")
        out = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return out

    def string(self) -> str:
        (n,) = self.take("Q")
        if self.pos + n > len(self.buf):
            raise GgufError(f"{self.path}: a string of {n} bytes runs past the end at byte {self.pos}")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])[0]
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.take("IQ")
            if etype in _SCALARS:
                return list(self.take(f"{n}{_SCALARS[etype]}")) if n else []
            return [self.value(etype) for _ in range(n)]
        raise GgufError(f"{self.path}: unknown value type {vtype} at byte {self.pos}")


def read_metadata(path: str | Path) -> dict[str, object]:
    """Every key-value pair of the GGUF file at ``path`` (arrays as lists)."""
    p = str(path)
    try:
        with open(p, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            cur = _Cursor(mm, p)
            if len(mm) < 24 or mm[:4] != b"GGUF":
                raise GgufError(f"{p}: not a GGUF file (no 'GGUF' magic)")
            cur.pos = 4
            (version,) = cur.take("I")
            if version not in (2, 3):
                raise GgufError(f"{p}: GGUF version {version} is not supported (2 or 3)")
            _tensors, n_kv = cur.take("QQ")
            out: dict[str, object] = {}
            for _ in range(n_kv):
                key = cur.string()
                (vtype,) = cur.take("I")
                out[key] = cur.value(vtype)
            return out
    except (OSError, ValueError) as exc:
        if isinstance(exc, GgufError):
            raise
        raise GgufError(f"{p}: {exc}") from None
