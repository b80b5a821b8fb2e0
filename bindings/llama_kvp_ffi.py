"""cffi bindings of the pykvcache native API (native/include/llama-kvp.h).

The declarations are read from the installed header itself (the block between the `cffi-begin` and `cffi-end`
markers), so the C API has one source of truth. The library opened is the very libllama file that llama_cpp loads.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Tuple

import cffi


def cdef_from_header(text: str) -> str:
    """Return the cffi declarations found between the cffi markers of a header."""
    m = re.search(r"//\s*cffi-begin[^\n]*\n(.*?)//\s*cffi-end", text, re.S)
    if m is None:
        raise ValueError("llama-kvp.h has no cffi-begin/cffi-end block")
    body = re.sub(r"//[^\n]*", "", m.group(1)).replace("LLAMA_KVP_API ", "")  # the export macro is not C cffi reads
    lines = [ln for ln in body.splitlines() if not ln.lstrip().startswith("#")]
    return "\n".join(lines)


def open_library(lib_path: Path, header_path: Path) -> Tuple[cffi.FFI, Any]:
    """Open the native library at lib_path with the declarations of header_path."""
    ffi = cffi.FFI()
    ffi.cdef(cdef_from_header(Path(header_path).read_text()))
    lib = ffi.dlopen(str(lib_path))
    return ffi, lib
