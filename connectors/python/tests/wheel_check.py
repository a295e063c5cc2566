# SPDX-License-Identifier: Apache-2.0
"""Run by tests/python/run_python_tests.sh (wheel) inside a fresh venv that
has only the repaired wheel (and cffi) installed, with no GLIBC_TUNABLES,
LD_PRELOAD or LD_LIBRARY_PATH.  Checks that the wheel is what a Python user
can install without kvplane's build dependencies:

- loads into any process: neither the extension nor any library it pulls in
  carries initial-exec TLS (DF_STATIC_TLS), glibc's own excepted -- such a
  library cannot be dlopen'ed into a running process (jemalloc did that);
- self-contained: every shared library the extension needs resolves inside
  the installed wheel (auditwheel's kvplane.libs) or is one of the system
  libraries the manylinux policy lets a wheel assume; and it still imports
  and works with the system's library directory replaced by those libraries
  alone (a mount namespace; skipped where unshare is not allowed);
- honest platform tag: manylinux_X_Y, no older than the newest glibc symbol
  version any bundled ELF file needs, no newer than the glibc it was built on.

Exit 0 pass, 1 fail."""
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

# glibc's libraries are always there at process start (and use static TLS
# themselves); the rest of what the manylinux policy lets a wheel assume.
GLIBC = ("libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2",
         "librt.so.1", "libutil.so.1", "libresolv.so.2", "libnsl.so.1",
         "libcrypt.so.1", "ld-linux-x86-64.so.2", "linux-vdso.so.1")
MANYLINUX = GLIBC + ("libgcc_s.so.1", "libstdc++.so.6")


def fail(msg):
    print(f"FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def ldd(path):
    """{soname: resolved path or None} of path's whole dependency closure."""
    out = subprocess.run(["ldd", path], capture_output=True, text=True,
                         check=True).stdout
    deps = {}
    for line in out.splitlines():
        m = re.match(r"\s*(\S+)\s+=>\s+(not found|\S+)", line)
        if m:
            deps[m.group(1)] = None if m.group(2) == "not found" else m.group(2)
        elif (m := re.match(r"\s*(/\S+)\s+\(", line)):
            deps[os.path.basename(m.group(1))] = m.group(1)
    return deps


def static_tls(path):
    dyn = subprocess.run(["readelf", "-dW", path], capture_output=True,
                         text=True, check=True).stdout
    return any("(FLAGS)" in l and "STATIC_TLS" in l for l in dyn.splitlines())


def check_tls(so, deps):
    bad = [p for n, p in [("extension", so)] + sorted(deps.items())
           if p and n not in GLIBC and static_tls(p)]
    if bad:
        fail(f"initial-exec TLS (STATIC_TLS) in {bad}: a running process "
             "cannot load them")


def check_closure(so, deps, site):
    missing = [n for n, p in deps.items() if p is None]
    if missing:
        fail(f"{so}: not found: {missing}")
    outside = {n: p for n, p in deps.items()
               if n not in MANYLINUX and
               not os.path.realpath(p).startswith(os.path.realpath(site) + os.sep)}
    if outside:
        fail(f"resolved outside the wheel and the manylinux system libraries: "
             f"{outside}")
    bundled = [n for n, p in deps.items() if n not in MANYLINUX]
    if not any(n.startswith("libzmq") for n in bundled):
        fail(f"libzmq is not bundled: {bundled}")
    return bundled


def glibc_needed(paths):
    need = (2, 0)
    for p in paths:
        out = subprocess.run(["readelf", "-VW", p], capture_output=True,
                             text=True, check=True).stdout
        for a, b in re.findall(r"Name: GLIBC_(\d+)\.(\d+)", out):
            need = max(need, (int(a), int(b)))
    return need


def check_tag(wheel, elfs):
    tags = os.path.basename(wheel)[:-4].split("-")[-1].split(".")
    plat = [tuple(map(int, m.groups())) for t in tags
            if (m := re.fullmatch(r"manylinux_(\d+)_(\d+)_x86_64", t))]
    if not plat or any(not t.startswith("manylinux") for t in tags):
        fail(f"platform tag {tags}: not manylinux (auditwheel repair not run?)")
    need = glibc_needed(elfs)
    here = tuple(map(int, os.confstr("CS_GNU_LIBC_VERSION").split()[1].split(".")[:2]))
    if min(plat) < need or max(plat) > here:
        fail(f"platform tag {tags} claims glibc {min(plat)}..{max(plat)}; the "
             f"ELF files need {need}, built on {here}")
    return tags, need


SMOKE = """
import kvplane
ns = kvplane.Namespace("m", 16)
keys = kvplane.Hasher(ns).hash(range(40))
assert keys[0].hex() == "1c4550b637f66cd8aa2c021e12a061de", keys[0].hex()
with kvplane.TierStore(dram_bytes=8 << 20) as t:
    t.add_namespace(ns)
    t.put(ns, keys[0], b"x" * 100)
    t.put(ns, keys[1], b"y" * 300000)
    assert t.get(ns, keys[0]) == b"x" * 100 and t.get(ns, keys[1]) == b"y" * 300000
print("smoke ok")
"""


def hidden_run():
    """The smoke test with the system's library directory replaced by the
    manylinux libraries (and python's own: libz, libexpat) in a private
    mount namespace: nothing else can resolve there.  None: no namespace."""
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        print("note: no private mount namespace here (unshare -rm); the ldd "
              "check stands alone")
        return None
    libdir = os.path.dirname(os.path.realpath(ldd(sys.executable)["libc.so.6"]))
    with tempfile.TemporaryDirectory() as tmp:
        for name in set(MANYLINUX) | set(ldd(sys.executable)):
            src = os.path.join(libdir, name)
            if os.path.exists(src):
                shutil.copy2(src, os.path.join(tmp, name))
        r = subprocess.run(["unshare", "-rm", "sh", "-c",
                            'mount --bind "$2" "$3" || exit 77; exec "$0" -c "$1"',
                            sys.executable, SMOKE, tmp, libdir],
                           capture_output=True, text=True)
    if r.returncode == 77:
        print(f"note: cannot mount over {libdir} ({r.stderr.strip()}); the ldd "
              "check stands alone")
        return None
    if r.returncode != 0 or "smoke ok" not in r.stdout:
        fail(f"import with only the wheel and the manylinux libraries:\n"
             f"{r.stdout}{r.stderr}")
    return libdir


def main(wheel):
    for var in ("GLIBC_TUNABLES", "LD_PRELOAD", "LD_LIBRARY_PATH"):
        if os.environ.get(var):
            fail(f"{var} is set: the check must run without it")
    names = zipfile.ZipFile(wheel).namelist()
    ext = [n for n in names if n.startswith("kvplane/_kvplane") and n.endswith(".so")]
    assert ext, names
    assert "kvplane/py.typed" in names, names
    assert not any("libkvplane" in n for n in names), names  # linked in, not beside
    # the files first, import after: a library that cannot load must fail
    # the check that names it, not the import
    here = importlib.util.find_spec("kvplane").submodule_search_locations[0]
    site = os.path.dirname(here)
    assert os.path.realpath(here).startswith(os.path.realpath(sys.prefix)), here
    so = os.path.join(here, os.path.basename(ext[0]))
    deps = ldd(so)
    check_tls(so, deps)
    bundled = check_closure(so, deps, site)
    libs = glob.glob(os.path.join(site, "kvplane.libs", "*.so*"))
    tags, need = check_tag(wheel, [so] + libs)
    exec(SMOKE, {})
    import kvplane
    hidden = hidden_run()
    print(f"wheel ok: {os.path.basename(wheel)} ({len(names)} files), kvplane "
          f"{kvplane.__version__}; bundled {sorted(bundled)}; no initial-exec "
          f"TLS; needs glibc {need[0]}.{need[1]}; "
          + (f"imports with only the manylinux libraries in {hidden}" if hidden
             else "hidden-library run skipped"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
