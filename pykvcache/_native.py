"""Locates the patched libllama inside the package, points llama_cpp at it and opens the cffi API on it."""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, Optional, Tuple

PACKAGE_DIR = Path(__file__).resolve().parent
LIB_DIR = PACKAGE_DIR / "lib"
HEADER = PACKAGE_DIR / "include" / "llama-kvp.h"
API_VERSION = 23


class NativeLibraryError(ImportError):
    """The patched native library is missing or another libllama is already loaded."""


def _lib_file(name: str) -> Path:
    if sys.platform == "darwin":
        return LIB_DIR / f"lib{name}.dylib"
    if sys.platform == "win32":
        return LIB_DIR / f"{name}.dll"
    return LIB_DIR / f"lib{name}.so"


def library_path() -> Path:
    """Return the path of the patched libllama shipped in the package."""
    path = _lib_file("llama")
    if not path.is_file():
        raise NativeLibraryError(
            f"pykvcache's native library is missing ({path}); build and install the package with `bash scripts/setup.sh`"
        )
    return path


def _loaded_llama_cpp_lib() -> Path | None:
    mod = sys.modules.get("llama_cpp.llama_cpp")
    lib = getattr(mod, "_lib", None) if mod is not None else None
    name = getattr(lib, "_name", None)
    return Path(name).resolve() if name else None


def import_llama_cpp() -> Any:
    """Import llama_cpp so that it runs on pykvcache's patched libllama."""
    ours = library_path().resolve()
    if "llama_cpp" in sys.modules:
        loaded = _loaded_llama_cpp_lib()
        if loaded is not None and loaded != ours:
            raise NativeLibraryError(
                f"llama_cpp was imported before pykvcache and loaded {loaded}; pykvcache needs its patched library "
                f"{ours}: import pykvcache before llama_cpp (or set LLAMA_CPP_LIB_PATH={LIB_DIR})"
            )
    else:
        current = os.environ.get("LLAMA_CPP_LIB_PATH")
        if current and Path(current).resolve() != LIB_DIR:
            warnings.warn(f"LLAMA_CPP_LIB_PATH={current} is replaced by pykvcache's {LIB_DIR}", stacklevel=3)
        os.environ["LLAMA_CPP_LIB_PATH"] = str(LIB_DIR)
    import llama_cpp

    return llama_cpp


_native_lock = threading.Lock()
_native_pair: Optional[Tuple[Any, Any]] = None


def native() -> Tuple[Any, Any]:
    """Return (ffi, lib) of the native API, opened on the library llama_cpp uses."""
    global _native_pair
    if _native_pair is not None:
        return _native_pair
    # one pair for the process: two threads opening it at once made two ffi instances, whose structs do not mix
    with _native_lock:
        if _native_pair is None:
            from ._bindings.llama_kvp_ffi import open_library

            import_llama_cpp()
            ffi, lib = open_library(library_path(), HEADER)
            version = lib.llama_kvp_api_version()
            if version != API_VERSION:
                raise NativeLibraryError(f"native API version {version} does not match the Python package "
                                         f"({API_VERSION})")
            _native_pair = (ffi, lib)
    return _native_pair


def last_error() -> str:
    """Return the native error message of the last failed call on this thread."""
    ffi, lib = native()
    return ffi.string(lib.llama_kvp_last_error()).decode("utf-8", "replace")


def ctx_pointer(ctx: Any) -> Any:
    """Convert a llama_cpp context pointer (ctypes) into a cffi `struct llama_context *`."""
    ffi, _ = native()
    addr = ctypes.cast(ctx, ctypes.c_void_p).value
    if not addr:
        raise ValueError("the llama context is closed")
    return ffi.cast("struct llama_context *", addr)
