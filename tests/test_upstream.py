"""llama-cpp-python 0.3.36's own tests (from the sdist the build downloads) run on pykvcache.Llama, without a policy
and with every policy at a small budget. Only the model-specific expected strings are edited
(tests/upstream/llama-cpp-python-0.3.36.patch); tests/upstream/upstream_conftest.py swaps the hub models for the
embedded one and skips, with their reason, the tests of model kinds pykvcache does not embed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from pykvcache.corpus import cache_root

VERSION = "0.3.36"
HERE = Path(__file__).parent / "upstream"
SDIST = f"llama_cpp_python-{VERSION}"

# llama-cpp-python's tests use n_ctx 32 or 64: budgets of 16 tokens make every policy evict in them (snapkv observing
# every step: at its every=16 their short generations end before its first decode-time eviction)
POLICIES = [
    "none",
    "sink_recent:n_sink=4,n_recent=12",
    "snapkv:budget=16,window=8,every=1",
    "h2o:budget=16,n_recent=8",
    "pyramid:budget=16,window=8",
    "entropy:budget=16,n_recent=8",
]

# tests that need a model kind pykvcache does not embed (the hub is never used): skipped, with the reason
N_SKIPPED = 11
N_PASSED = 15


def sdist_tarball() -> Path:
    return cache_root() / "sdist" / f"{SDIST}.tar.gz"  # where the build downloads it


@pytest.fixture(scope="module")
def upstream_tests(tmp_path_factory) -> Path:
    """The sdist's tests/ (and the vocab model they read) unpacked, patched, with our conftest beside them."""
    tgz = sdist_tarball()
    if not tgz.is_file() and os.environ.get("LLAMA_CPP_SOURCE_DIR"):
        # a build from a local llama.cpp tree downloads no sdist: fetch it as the build would, where a registry exists
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
                        f"llama-cpp-python=={VERSION}", "-d", str(tgz.parent)], capture_output=True)
    if not tgz.is_file():
        # the upstream suite is the sdist's tests/: without it nothing here can be checked, which is a failure
        pytest.fail(f"the llama-cpp-python {VERSION} sdist (its tests/ are the upstream suite) is missing: {tgz}; the "
                    f"build downloads it, a build from LLAMA_CPP_SOURCE_DIR fetches it here when a package registry "
                    f"is reachable, else copy {tgz.name} there")
    root = tmp_path_factory.mktemp("upstream")
    vocab = f"{SDIST}/vendor/llama.cpp/models/ggml-vocab-llama-spm.gguf"
    with tarfile.open(tgz) as t:
        members = [m for m in t.getmembers() if m.name.startswith(f"{SDIST}/tests/") or m.name == vocab]
        if hasattr(tarfile, "data_filter"):
            t.extractall(root, members=members, filter="data")
        else:  # Python < 3.11.4: the members are the sdist's tests/ and one model file
            t.extractall(root, members=members)
    src = root / SDIST
    subprocess.run(["patch", "-p1", "-s", "-i", str(HERE / f"llama-cpp-python-{VERSION}.patch")], cwd=src, check=True)
    shutil.copy(HERE / "upstream_conftest.py", src / "tests" / "conftest.py")
    return src


@pytest.mark.parametrize("policy", POLICIES)
def test_llama_cpp_python_suite(upstream_tests, policy, tmp_path):
    record = tmp_path / "record.json"
    env = dict(os.environ, PYKVCACHE_TEST_POLICY=policy, PYKVCACHE_TEST_RECORD=str(record))
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests"],
        cwd=upstream_tests, env=env, capture_output=True, text=True, timeout=900,
    )
    tail = res.stdout[-4000:] + res.stderr[-2000:]
    assert res.returncode == 0, tail
    assert f"{N_PASSED} passed, {N_SKIPPED} skipped" in res.stdout, tail
    # every skip is a test that needs a model kind from the hub, with the conftest's reason
    skips = [ln for ln in res.stdout.splitlines() if ln.startswith("SKIPPED")]
    assert len(skips) == N_SKIPPED and all("from the hub: pykvcache's tests download nothing" in ln for ln in skips), tail
    # the policy under test ran in the suite's contexts and evicted there
    rec = json.loads(record.read_text())
    assert rec["policy"] == policy
    if policy == "none":
        assert rec["contexts"] == 0
    else:
        assert rec["contexts"] > 0 and rec["evicted"] > 0, rec
