# SPDX-License-Identifier: Apache-2.0
"""Every ```python block of README.md (none today), docs/python.md and
docs/engine-integration.md runs (the blocks of one file share a namespace,
in order), so the examples stay true to the API."""
import contextlib
import io
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[3] / "docs"


def blocks(md):
    lines = md.read_text().split("\n")
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            out.append((i + 1, "\n".join(lines[i + 1:j])))
            i = j
        i += 1
    return out


@pytest.mark.parametrize("name,least", [("python.md", 4),
                                        ("engine-integration.md", 4),
                                        ("../README.md", 0)])
def test_doc_examples_run(name, least):
    md = DOCS / name
    if not md.is_file():
        pytest.skip(f"{md} not found (run from the source tree)")
    found = blocks(md)
    assert len(found) >= least, found
    scope: dict = {}
    for line, code in found:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(code, f"{md}:{line}", "exec"), scope)
