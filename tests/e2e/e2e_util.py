# SPDX-License-Identifier: Apache-2.0
"""What the GPU end-to-end scripts share (tests/e2e/*.py, run as
`python3 tests/e2e/NAME.py`, so this directory is on sys.path)."""
import os


def pick_nvme_dir(asked, prefix):
    """A new directory PREFIX-PID for kvtier's slab files, inside `asked` or
    else the first of /var/tmp, /tmp, . whose file system takes O_DIRECT
    (the slab files need it; tmpfs does not)."""
    for d in ([asked] if asked else ["/var/tmp", "/tmp", "."]):
        probe = os.path.join(d, f".kvp-odirect-{os.getpid()}")
        try:
            fd = os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
        except OSError:
            continue
        os.close(fd)
        os.unlink(probe)
        sub = os.path.join(os.path.abspath(d), f"{prefix}-{os.getpid()}")
        os.makedirs(sub)
        return sub
    raise RuntimeError(f"no directory here takes O_DIRECT (tried {asked or '/var/tmp, /tmp, .'})")
