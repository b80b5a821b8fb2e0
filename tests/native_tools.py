"""Runs the native check and benchmark binaries installed beside kvbench (pykvcache/bin)."""

from __future__ import annotations

import os
import subprocess

import pytest

from pykvcache import cli


def run_tool(name: str, *args: str, env=None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run the installed binary `name` with args (outside the repo, extra env on top of ours); fail if it is missing."""
    exe = cli.tool_path(name)
    if not exe.is_file():
        pytest.fail(f"{name} is missing ({exe}); reinstall with `bash scripts/setup.sh`")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout, cwd="/",
                          env={**os.environ, **(env or {})})
