"""Ending this process's XLA:CPU collective connections (the abort of ``distributed/mpmd.py``).

XLA:CPU's cross-process collectives run over gloo's TCP pairs, opened inside jaxlib; a
thread blocked in one cannot be interrupted from Python. Shutting down the pair's socket
(``shutdown(SHUT_RDWR)``, found among this process's descriptors) makes the blocked gloo
operation fail at once ("Connection closed by peer"): XLA returns that error from the launch,
so it is raised in the thread that launched the collective, and every later collective over
those pairs fails the same way. (Measured on jaxlib 0.10: no crash, the process's local
computations go on.)

Which sockets: gloo listens on a port of its own; a pair is a connection accepted on one of
this process's gloo listeners, or made to a peer's. The listeners are this process's listening
TCP sockets other than the ones whose owners are known (the p2p listener, the c10d store's and
JAX's coordination service's ports); connections to those known ports are never touched.
"""
from __future__ import annotations

import os
import socket


def _tcp_sockets():
    """(socket object over a duplicate descriptor, listening?) of this process's TCP sockets;
    the caller closes them (closing a duplicate leaves the connection alone)."""
    out = []
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:  # not Linux: nothing found, nothing ended
        return out
    for fd in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(fd)))
        except (OSError, ValueError):
            continue
        if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
            s.close()
            continue
        try:
            listening = bool(s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
        except OSError:
            s.close()
            continue
        out.append((s, listening))
    return out


def listeners(known_ports) -> list:
    """The ports of this process's listening TCP sockets not in ``known_ports``: gloo's."""
    ports = []
    for s, listening in _tcp_sockets():
        try:
            port = s.getsockname()[1]
            if listening and port not in known_ports:
                ports.append(port)
        finally:
            s.close()
    return sorted(set(ports))


def shutdown(own: list, peers: list, known_ports) -> int:
    """Shut down this process's connections accepted on its gloo listener ports ``own`` or
    made to the peers' gloo listener ports ``peers``; returns how many."""
    n = 0
    for s, listening in _tcp_sockets():
        try:
            if listening:
                continue
            try:
                local, remote = s.getsockname()[1], s.getpeername()[1]
            except OSError:  # not connected
                continue
            if local in known_ports or remote in known_ports:
                continue
            if local in own or remote in peers:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                    n += 1
                except OSError:
                    pass
        finally:
            s.close()
    return n
