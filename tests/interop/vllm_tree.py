# SPDX-License-Identifier: Apache-2.0
"""vLLM 0.33.0's own KV-event publisher and block hash functions, without torch.

`build` copies two REAL files out of the pinned vLLM wheel (zipfile, sha256
checked) into a generated package tree and surrounds them with plain
stand-ins for the five names they import from the rest of vLLM; `load`
imports them from that tree.  Nothing else of vLLM is used.

    real (byte for byte from the wheel):
      vllm/distributed/kv_events.py  ZmqEventPublisher, EventBatch/KVEventBatch,
                                     BlockStored, BlockRemoved, AllBlocksCleared
      vllm/utils/hashing.py          sha256 (pickle), sha256_cbor, xxhash,
                                     xxhash_cbor
    stand-ins (this file writes them; each says so in its first line):
      vllm/__init__.py, vllm/{config,distributed,utils,v1,v1/core}/__init__.py
      vllm/config/kv_events.py       KVEventsConfig: a plain dataclass
      vllm/logger.py                 init_logger -> logging.getLogger
      vllm/utils/network_utils.py    get_ip, get_tcp_uri, is_valid_ipv6_address,
                                     split_zmq_path
      vllm/v1/core/kv_cache_utils.py ExternalBlockHash = bytes | int

usage: vllm_tree.py build --wheel WHEEL --out DIR   (tests/interop/setup.sh)
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import zipfile

VLLM_VERSION = "0.33.0"
WHEEL_NAME = "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
WHEEL_SHA256 = "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa"
REAL_FILES = {
    "vllm/distributed/kv_events.py":
        "82b362a0a7f89318d9127addfce254d537f5078a31aa87beb08493b0953895ee",
    "vllm/utils/hashing.py":
        "2e8fcc81dd675ed0fba49de8fd8658b4dab9ae26a917edaf5164bf266c56b4df",
}

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_TREE = os.path.join(ROOT, ".cache", "interop", "vllm033")

_PKG = "# STAND-IN (tests/interop/vllm_tree.py): an empty package marker.\n"

# Every line of these files is a stand-in: none of it comes from vLLM.
STANDINS = {
    "vllm/__init__.py":
        "# STAND-IN (tests/interop/vllm_tree.py): the whole file.  The real\n"
        "# vllm/__init__.py imports the engine (torch); only two real modules\n"
        "# live in this tree: distributed/kv_events.py and utils/hashing.py.\n"
        f'__version__ = "{VLLM_VERSION}"\n',
    "vllm/config/__init__.py": _PKG,
    "vllm/distributed/__init__.py": _PKG,
    "vllm/utils/__init__.py": _PKG,
    "vllm/v1/__init__.py": _PKG,
    "vllm/v1/core/__init__.py": _PKG,
    "vllm/config/kv_events.py":
        "# STAND-IN (tests/interop/vllm_tree.py): the whole file.  The real\n"
        "# KVEventsConfig is a pydantic @config class; the publisher only builds\n"
        "# one from the fields below (kv_events.py, ZmqEventPublisher.__init__)\n"
        "# and returns it from get_publisher_config().  Defaults as in 0.33.0.\n"
        "from dataclasses import dataclass\n"
        "\n"
        "\n"
        "@dataclass\n"
        "class KVEventsConfig:\n"
        "    enable_kv_cache_events: bool = False\n"
        "    publisher: str | None = None\n"
        '    endpoint: str = "tcp://*:5557"\n'
        "    replay_endpoint: str | None = None\n"
        "    buffer_steps: int = 10_000\n"
        "    hwm: int = 100_000\n"
        "    max_queue_size: int = 100_000\n"
        '    topic: str = ""\n'
        "\n"
        "    def __post_init__(self):\n"
        "        if self.publisher is None:\n"
        '            self.publisher = "zmq" if self.enable_kv_cache_events else "null"\n',
    "vllm/logger.py":
        "# STAND-IN (tests/interop/vllm_tree.py): the whole file.  The real\n"
        "# init_logger returns a configured _VllmLogger; a stdlib logger suffices.\n"
        "import logging\n"
        "\n"
        "\n"
        "def init_logger(name: str) -> logging.Logger:\n"
        "    return logging.getLogger(name)\n",
    "vllm/utils/network_utils.py":
        "# STAND-IN (tests/interop/vllm_tree.py): the whole file.  Only\n"
        "# ZmqEventPublisher._bind uses these, and only for 'tcp://*:0'; the\n"
        "# harness never binds that.  get_ip: VLLM_HOST_IP or 127.0.0.1 (the real\n"
        "# one probes the default route); split_zmq_path: urllib.parse instead of\n"
        "# urllib3.util.parse_url.\n"
        "import ipaddress\n"
        "import os\n"
        "from urllib.parse import urlsplit\n"
        "\n"
        "\n"
        "def get_ip() -> str:\n"
        '    return os.environ.get("VLLM_HOST_IP") or "127.0.0.1"\n'
        "\n"
        "\n"
        "def is_valid_ipv6_address(address: str) -> bool:\n"
        "    try:\n"
        "        ipaddress.IPv6Address(address)\n"
        "        return True\n"
        "    except ValueError:\n"
        "        return False\n"
        "\n"
        "\n"
        "def get_tcp_uri(ip: str, port: int) -> str:\n"
        "    if is_valid_ipv6_address(ip):\n"
        '        return f"tcp://[{ip}]:{port}"\n'
        '    return f"tcp://{ip}:{port}"\n'
        "\n"
        "\n"
        "def split_zmq_path(path: str) -> tuple[str, str, str]:\n"
        "    parsed = urlsplit(path)\n"
        "    if not parsed.scheme:\n"
        '        raise ValueError(f"Invalid zmq path: {path}")\n'
        '    host = parsed.hostname or ""\n'
        '    port = "" if parsed.port is None else str(parsed.port)\n'
        '    if parsed.scheme == "tcp" and not (host and port):\n'
        '        raise ValueError(f"Invalid zmq path: {path}")\n'
        "    return parsed.scheme, host, port\n",
    "vllm/v1/core/kv_cache_utils.py":
        "# STAND-IN (tests/interop/vllm_tree.py): the whole file.  kv_events.py\n"
        "# imports only this alias from the real kv_cache_utils.py (which needs\n"
        "# torch); the alias is copied verbatim from vLLM 0.33.0.\n"
        "from typing import TypeAlias\n"
        "\n"
        "ExternalBlockHash: TypeAlias = bytes | int\n",
}


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def tree_ok(out: str) -> bool:
    """True when `out` holds exactly the files build() writes."""
    for rel, digest in REAL_FILES.items():
        p = os.path.join(out, rel)
        if not os.path.isfile(p) or sha256_file(p) != digest:
            return False
    for rel, text in STANDINS.items():
        p = os.path.join(out, rel)
        try:
            with open(p, "rb") as f:
                if f.read() != text.encode():
                    return False
        except OSError:
            return False
    return True


def build(wheel: str, out: str) -> list[str]:
    """Writes the tree; returns what it did, one line each."""
    done = []
    with zipfile.ZipFile(wheel) as z:
        for rel, digest in REAL_FILES.items():
            data = z.read(rel)
            got = hashlib.sha256(data).hexdigest()
            if got != digest:
                raise SystemExit(f"vllm_tree: {wheel}:{rel} has sha256 {got}, "
                                 f"expected {digest} (not vLLM {VLLM_VERSION}?)")
            _write(os.path.join(out, rel), data)
            done.append(f"real      {rel} (from {os.path.basename(wheel)})")
    for rel, text in STANDINS.items():
        _write(os.path.join(out, rel), text.encode())
        done.append(f"stand-in  {rel}")
    return done


_loaded: dict = {}


def load(tree: str | None = None):
    """Imports the real modules from the tree; returns (kv_events, hashing).

    The tree goes first on sys.path, and the modules must come from it: an
    installed vllm elsewhere would make the harness test the wrong code."""
    if "mods" in _loaded:
        return _loaded["mods"]
    tree = os.path.abspath(tree or os.environ.get("KVP_VLLM_TREE") or DEFAULT_TREE)
    if not tree_ok(tree):
        raise SystemExit(f"vllm_tree: {tree} is missing or stale: run "
                         "tests/interop/setup.sh")
    sys.path.insert(0, tree)
    import vllm.distributed.kv_events as kv_events  # noqa: E402
    import vllm.utils.hashing as hashing  # noqa: E402
    for m, rel in ((kv_events, "vllm/distributed/kv_events.py"),
                   (hashing, "vllm/utils/hashing.py")):
        if os.path.abspath(m.__file__) != os.path.join(tree, rel):
            raise SystemExit(f"vllm_tree: {m.__name__} came from {m.__file__}, "
                             f"not from {tree}")
    _loaded["mods"] = (kv_events, hashing)
    return _loaded["mods"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write the tree from the wheel")
    b.add_argument("--wheel", required=True)
    b.add_argument("--out", default=DEFAULT_TREE)
    c = sub.add_parser("check", help="exit 0 when the tree is complete")
    c.add_argument("--out", default=DEFAULT_TREE)
    a = ap.parse_args()
    if a.cmd == "check":
        return 0 if tree_ok(a.out) else 1
    for line in build(a.wheel, a.out):
        print(f"  {line}")
    if not tree_ok(a.out):
        print("vllm_tree: the tree does not check after building", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
