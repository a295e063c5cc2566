# SPDX-License-Identifier: Apache-2.0
"""Run by tests/python/run_python_tests.sh (wheel) inside a fresh venv that
has only the built wheel (and cffi) installed: the wheel is self-contained
(libkvplane bundled in the extension, no libkvplane.so needed), typed, and
works.  Exit 0 pass, 1 fail."""
import os
import subprocess
import sys
import zipfile

import kvplane


def main(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    ext = [n for n in names if n.startswith("kvplane/_kvplane") and n.endswith(".so")]
    assert ext, names
    assert "kvplane/py.typed" in names, names
    assert not any("libkvplane" in n for n in names), names  # linked in, not beside
    here = os.path.dirname(kvplane.__file__)
    assert os.path.realpath(here).startswith(os.path.realpath(sys.prefix)), here
    so = os.path.join(here, os.path.basename(ext[0]))
    ldd = subprocess.run(["ldd", so], capture_output=True, text=True).stdout
    assert "libkvplane" not in ldd and "not found" not in ldd, ldd
    ns = kvplane.Namespace("m", 16)
    keys = kvplane.Hasher(ns).hash(range(40))
    # the golden key `kvplane hash --model m` prints for tokens 0..39
    assert keys[0].hex() == "1c4550b637f66cd8aa2c021e12a061de", keys[0].hex()
    assert keys.tail == 8 and kvplane.__version__.count(".") == 2
    with kvplane.TierStore(dram_bytes=8 << 20) as t:
        t.add_namespace(ns)
        t.put(ns, keys[0], b"x" * 100)
        assert t.get(ns, keys[0]) == b"x" * 100
    print(f"wheel ok: {os.path.basename(wheel)} ({len(names)} files), kvplane "
          f"{kvplane.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
