# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures.  Environment (set by tests/python/run_python_tests.sh):
KVP_SHARED_DIR (../shared), KVPLANE_CLI (the `kvplane` program),
KVPLANE_ROUTE_REF (tests/python/route_ref)."""
import os
import shutil
from pathlib import Path

import pytest

import kvplane

HERE = Path(__file__).resolve().parent


def shared_dir() -> Path:
    return Path(os.environ.get("KVP_SHARED_DIR", HERE.parents[2].parent / "shared"))


def program(var: str) -> str:
    p = os.environ.get(var)
    if not p or not os.access(p, os.X_OK):
        pytest.skip(f"{var} not set (run through CTest: test_python)")
    return p


@pytest.fixture
def ns():
    return kvplane.Namespace("meta-llama/Llama-3.1-8B-Instruct", 16,
                             tokenizer_id="llama3", kv_layout="vllm-nhd:bf16")


@pytest.fixture
def hasher(ns):
    with kvplane.Hasher(ns) as h:
        yield h


@pytest.fixture
def o_direct_dir(tmp_path_factory):
    """A real directory whose file system takes O_DIRECT (tmpfs may not):
    the first of /var/tmp, the pytest tmp dir, the build dir."""
    for base in ("/var/tmp", str(tmp_path_factory.getbasetemp()), os.getcwd()):
        try:
            d = Path(base) / f"kvp-py-{os.getpid()}-{len(os.listdir(base))}"
            d.mkdir()
        except OSError:
            continue
        probe = d / "probe"
        try:
            fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
            os.close(fd)
            probe.unlink()
            yield d
            shutil.rmtree(d, ignore_errors=True)
            return
        except OSError:
            shutil.rmtree(d, ignore_errors=True)
    pytest.skip("no directory here takes O_DIRECT")
