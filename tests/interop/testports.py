"""free_port() for the tests: bench/live/loopports.py, shared with `make live`'s
scripts, says why it draws below the ephemeral range."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "..", "bench", "live"))
from loopports import free_port  # noqa: E402,F401
