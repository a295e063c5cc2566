"""Loopback ports for scripts and tests that hand a port to another process
(make live's scripts here; the tests through tests/interop/testports.py).

A port found free by binding port 0 comes from the kernel's ephemeral range
(ip_local_port_range, 32768-60999 by default), and is handed back to that
range when the probe socket closes: another process's bind(0) or outgoing
connection may take it before the server this test starts binds it (seen
once in CI as EADDRINUSE).  A port from below the ephemeral range is never
handed out by the kernel, so only another test picking the same random port
can collide, and the bind check here narrows even that to the moment
between this check and the server's bind."""
import random
import socket

_rng = random.SystemRandom()


def _ephemeral_low(default: int = 32768) -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def free_port(low: int = 20000) -> int:
    """A loopback TCP port below the ephemeral range that binds now."""
    high = min(_ephemeral_low(), 32768)
    if high - low < 1000:  # an unusual range: fall back to the kernel's pick
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for _ in range(200):
        p = _rng.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                continue
            return p
    raise RuntimeError(f"no free loopback port in [{low}, {high})")
