# SPDX-License-Identifier: Apache-2.0
"""Builds kvplane._kvplane: cffi (API mode) over libkvplane's static archives.

Where libkvplane comes from, first match wins:
  KVPLANE_BUILD_DIR=DIR   an existing CMake build of this repository
                          (libkvplane.a and connectors/libkvplane_events_static.a
                          already built there: CTest uses the test build)
  otherwise               CMake configures and builds the two archives from
                          KVPLANE_SOURCE_DIR (default: the repository this
                          folder sits in, two levels up) in build_temp;
                          CMAKE_ARGS adds configure options.
The archives are linked into the extension (the wheel bundles libkvplane);
their system dependencies (libxxhash, libcbor, libcrypto, libyaml, liburing,
libzmq, libmsgpackc) stay shared, read from the build's kvplane.pc and
pkg-config; `auditwheel repair` copies them into a manylinux wheel
(docs/python.md "A wheel for users").  None has initial-exec TLS, so the
extension loads into any Python process (test_python_wheel checks).
"""
import os
import re
import shlex
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent


def source_dir():
    env = os.environ.get("KVPLANE_SOURCE_DIR")
    root = Path(env) if env else HERE.parent.parent
    cml = root / "CMakeLists.txt"
    if not cml.is_file() or "project(kvplane" not in cml.read_text():
        raise SystemExit(f"kvplane: no kvplane source tree at {root} "
                         "(set KVPLANE_SOURCE_DIR or KVPLANE_BUILD_DIR)")
    return root


def version():
    try:
        text = (source_dir() / "CMakeLists.txt").read_text()
    except SystemExit:
        return "0.0.0"
    m = re.search(r"project\(kvplane VERSION ([0-9.]+)", text)
    return m.group(1) if m else "0.0.0"


def cmake_build(build_temp):
    """Configure + build the two archives; returns the build directory."""
    bdir = Path(build_temp).resolve() / "kvplane-cmake"
    cfg = ["cmake", "-S", str(source_dir()), "-B", str(bdir),
           "-DCMAKE_BUILD_TYPE=Release", "-DKVP_BUILD_TESTS=OFF",
           "-DKVP_BUILD_BENCH=OFF"] + shlex.split(os.environ.get("CMAKE_ARGS", ""))
    subprocess.run(cfg, check=True)
    jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", "1")
    subprocess.run(["cmake", "--build", str(bdir), "-j", jobs, "--target",
                    "kvplane_static", "kvplane_events_static"], check=True)
    return bdir


def pc_requires(bdir):
    """Requires.private of the build's kvplane.pc (liburing only when the
    build found it) plus the events connector's own libraries."""
    text = (bdir / "kvplane.pc").read_text()
    m = re.search(r"^Requires\.private:(.*)$", text, re.M)
    mods = m.group(1).split() if m else []
    return mods + ["libzmq", "msgpack", "libxxhash"]


def link_config(bdir):
    libs = pc_requires(bdir)
    flags = subprocess.run(["pkg-config", "--libs"] + libs, check=True,
                           capture_output=True, text=True).stdout.split()
    names = [f[2:] for f in flags if f.startswith("-l")]
    dirs = [f[2:] for f in flags if f.startswith("-L")]
    root = Path(re.search(r"^CMAKE_HOME_DIRECTORY:INTERNAL=(.*)$",
                                 (bdir / "CMakeCache.txt").read_text(),
                                 re.M).group(1))
    return {
        "include_dirs": [str(Path(root) / "include"), str(bdir / "include")],
        # events first: it refers to libkvplane's symbols
        "extra_objects": [str(bdir / "connectors" / "libkvplane_events_static.a"),
                          str(bdir / "libkvplane.a")],
        "libraries": names + ["m", "dl", "pthread"],
        "library_dirs": dirs,
    }


class BuildExt(build_ext):
    """Finds or builds libkvplane before compiling the cffi extension."""

    def run(self):
        env = os.environ.get("KVPLANE_BUILD_DIR")
        bdir = Path(env).resolve() if env else cmake_build(self.build_temp)
        for lib in ("libkvplane.a", "connectors/libkvplane_events_static.a"):
            if not (bdir / lib).is_file():
                raise SystemExit(f"kvplane: {bdir / lib} is missing (build "
                                 "targets kvplane_static kvplane_events_static)")
        cfg = link_config(bdir)
        for ext in self.extensions:
            for field, values in cfg.items():
                setattr(ext, field, list(getattr(ext, field) or []) + values)
        super().run()


setup(
    version=version(),
    cffi_modules=["kvplane_build.py:ffibuilder"],
    cmdclass={"build_ext": BuildExt},
)
