"""Ports for runs started at once, each its own: in the test process Lightning's forking launchers leave MASTER_PORT
set, which every interpreter started from it would otherwise share."""

from __future__ import annotations

import socket
from contextlib import ExitStack


def free_ports(n: int) -> list[int]:
    """`n` distinct ports that were free a moment ago (each held while the next is picked)."""
    with ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
