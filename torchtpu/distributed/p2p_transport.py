"""Payloads of large point-to-point transfers over direct TCP connections between ranks.

tpu_dist's send/recv match and order transfers through the group's c10d store
(``process_group.py``: the k-th send to a rank is its k-th receive from us). Small payloads
travel in the store value itself; a large one there is slow (two copies through the store
server) and, past the libuv store's 8 MiB message limit, broke the store's connection and
killed the job. Here each process listens on one socket (the interface that reaches
``MASTER_ADDR``, or ``TORCHTPU_P2P_ADDR``), publishes its address in each group's store, and a
large send's bytes go to the receiver's process directly: the sender hands them to a thread
that writes them to the connection (the send completes at once, as a buffered one did), and a
reader thread in the receiver keeps what arrives, by transfer key, until its receive takes it.
Counted: ``dist_p2p_socket_bytes``.
"""
from __future__ import annotations

import os
import queue
import socket
import struct
import threading
import time

import numpy as np

from ..runtime.metrics import count

_HEAD = struct.Struct("<IQ")  # key length, payload length
_QUERY = (1 << 64) - 1  # a payload length that marks a query: the key is the question
_ANSWER = struct.Struct("<I")  # an answer's length
answers: dict = {}  # question prefix (before the first "/") -> fn(question) -> bytes


class PeerGone(ConnectionError):
    """The peer's process does not listen any more (its connection is refused): it exited."""


def _local_host() -> str:
    env = os.environ.get("TORCHTPU_P2P_ADDR", "").strip()
    if env:
        return env
    master = os.environ.get("MASTER_ADDR", "127.0.0.1").strip() or "127.0.0.1"
    if master in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    try:  # the interface this host reaches MASTER_ADDR through (nothing is sent)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _recv_exact(conn, n: int):
    raw = np.empty(n + 64, np.uint8)  # 64-byte aligned: jax.device_put takes it without a copy
    off = (-raw.ctypes.data) % 64
    buf = raw[off:off + n]
    view = memoryview(buf)
    got = 0
    while got < n:
        k = conn.recv_into(view[got:], min(n - got, 1 << 24))
        if k == 0:
            raise ConnectionError("connection closed by the sending rank")
        got += k
    return buf


class Transport:
    """This process's listener, its outgoing connections and what has arrived."""

    def __init__(self):
        self.host = _local_host()
        self._srv = socket.create_server((self.host, 0), backlog=64)
        self.address = f"{self.host}:{self._srv.getsockname()[1]}"
        self._inbox: dict = {}  # transfer key -> payload (bytearray)
        self._cv = threading.Condition()
        self._errors: list = []  # a reader's failure: raised by a receive that waits
        self._out: dict = {}  # address -> (queue, thread)
        self._send_errors: dict = {}  # address -> the writer's failure
        threading.Thread(target=self._accept, name="tpu_p2p-accept", daemon=True).start()

    # ---- receiving ----
    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._read, args=(conn,), name="tpu_p2p-read",
                             daemon=True).start()

    def _read(self, conn) -> None:
        try:
            while True:
                try:
                    head = _recv_exact(conn, _HEAD.size)
                except ConnectionError:
                    return  # the peer closed (it exited): nothing was cut short
                klen, n = _HEAD.unpack(head)
                key = _recv_exact(conn, klen).tobytes().decode()
                if n == _QUERY:  # a peer asks (the MPMD check): answered on this connection
                    fn = answers.get(key.split("/", 1)[0])
                    try:
                        reply = fn(key) if fn is not None else b""
                    except Exception:  # noqa: BLE001  (no answer: the asker waits on)
                        reply = b""
                    conn.sendall(_ANSWER.pack(len(reply)) + reply)
                    continue
                data = _recv_exact(conn, n)
                with self._cv:
                    self._inbox[key] = data
                    self._cv.notify_all()
        except Exception as e:  # noqa: BLE001  (a peer died mid-transfer)
            with self._cv:
                self._errors.append(f"{type(e).__name__}: {e}")
                self._cv.notify_all()
        finally:
            conn.close()

    def wait_arrival(self, seconds: float) -> None:
        """Sleep up to ``seconds``, waking when a payload arrives (a receive polling the store
        for its transfer: the payload is queued before the transfer's store entry is set)."""
        with self._cv:
            self._cv.wait(seconds)

    def take(self, key: str, deadline: float, what: str):
        """The payload of transfer ``key`` (its store entry says it is on its way)."""
        with self._cv:
            while key not in self._inbox:
                if self._errors:
                    raise RuntimeError(f"{what}: the connection from the sender failed "
                                       f"({self._errors[-1]})")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"{what}: timed out waiting for the payload")
                self._cv.wait(min(left, 1.0))
            return self._inbox.pop(key)

    # ---- asking ----
    @staticmethod
    def ask(address: str, question: str, timeout: float = 2.0) -> bytes | None:
        """The answer of the process listening at ``address`` to ``question`` (its reader
        thread answers from ``answers``, while its main thread may be blocked in a
        collective); None when it does not answer within ``timeout``; ``PeerGone`` when its
        connection is refused (the process exited)."""
        host, port = address.rsplit(":", 1)
        try:
            conn = socket.create_connection((host, int(port)), timeout=timeout)
        except ConnectionRefusedError as e:
            raise PeerGone(f"connection to {address} refused") from e
        except OSError:
            return None
        try:
            k = question.encode()
            conn.sendall(_HEAD.pack(len(k), _QUERY) + k)
            n, = _ANSWER.unpack(_recv_exact(conn, _ANSWER.size).tobytes())
            return _recv_exact(conn, n).tobytes()
        except ConnectionError as e:
            raise PeerGone(f"connection to {address} closed: {e}") from e
        except OSError:
            return None
        finally:
            conn.close()

    # ---- sending ----
    def put(self, address: str, key: str, data, keep=None) -> None:
        """Queue ``data`` (a uint8 array) for ``address`` under ``key``; returns at once.
        ``keep``: what must stay alive (and so is never donated) until it is written: the
        device array ``data`` views."""
        err = self._send_errors.get(address)
        if err is not None:
            raise RuntimeError(f"tpu_dist send: the connection to {address} failed ({err})")
        q = self._out.get(address)
        if q is None:
            q = queue.Queue()
            host, port = address.rsplit(":", 1)
            conn = socket.create_connection((host, int(port)))
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._write, args=(address, conn, q),
                             name="tpu_p2p-write", daemon=True).start()
            self._out[address] = q
        count("dist_p2p_socket_bytes", data.nbytes)
        q.put((key, data, keep))

    def _write(self, address, conn, q) -> None:
        try:
            while True:
                key, data, keep = q.get()
                k = key.encode()
                conn.sendall(_HEAD.pack(len(k), data.nbytes) + k)
                conn.sendall(memoryview(data))
                del data, keep
        except Exception as e:  # noqa: BLE001
            self._send_errors[address] = f"{type(e).__name__}: {e}"


_transport: list = []


def transport() -> Transport:
    if not _transport:
        _transport.append(Transport())
    return _transport[0]
