"""Pickup latency and completions, reported from a worker's handlers to bench/sustained.py over UDP.

A handler calls :func:`started` with its job's enqueue wall-clock time first thing and :func:`ended`
last; the worker process gathers both and flushes them every 0.1 s as datagrams to the harness's
:class:`Listener` (at BENCH_PICKUP, ``host:port``): nothing is written to the measured database, and a
datagram a handful of jobs costs the same whatever the system. graphile-worker's Node worker
(bench/graphile/worker.mjs) sends the same datagrams.

A datagram: the jobs ended since the last one (uint32), then pickup latencies in milliseconds
(float32 each), little-endian.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from array import array

FLUSH_EVERY = 0.1
#: Latencies per datagram at most (8 KB: well under a loopback datagram's limit).
PER_DATAGRAM = 2000
HEADER = struct.Struct("<I")


class Reporter:
    """Gathers one worker process's latencies and completions; a daemon thread sends them."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.target = (host, int(port))
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.lock = threading.Lock()
        self.latencies = array("f")
        self.ends = 0
        threading.Thread(target=self._flush_forever, name="pickup-reporter", daemon=True).start()

    def started(self, enqueued_at: float) -> None:
        latency = (time.time() - enqueued_at) * 1000.0
        with self.lock:
            self.latencies.append(latency)

    def ended(self) -> None:
        with self.lock:
            self.ends += 1

    def _flush_forever(self) -> None:
        while True:
            time.sleep(FLUSH_EVERY)
            with self.lock:
                latencies, self.latencies = self.latencies, array("f")
                ends, self.ends = self.ends, 0
            for start in range(0, max(len(latencies), 1), PER_DATAGRAM):
                chunk = latencies[start : start + PER_DATAGRAM]
                if ends or chunk:
                    self.socket.sendto(HEADER.pack(ends) + chunk.tobytes(), self.target)
                ends = 0


_reporter: list[Reporter] = []
_reporter_lock = threading.Lock()


def reporter() -> Reporter:
    """This process's reporter, to BENCH_PICKUP (made at the first job)."""
    if not _reporter:
        with _reporter_lock:
            if not _reporter:
                _reporter.append(Reporter(os.environ["BENCH_PICKUP"]))
    return _reporter[0]


def started(enqueued_at: float) -> None:
    reporter().started(enqueued_at)


def ended() -> None:
    reporter().ended()


class Listener:
    """The harness's end: a thread receiving the workers' datagrams; :meth:`take` returns what came
    since the last call (jobs ended, latencies in ms)."""

    def __init__(self) -> None:
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.socket.bind(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.socket.getsockname()[1]}"
        self.lock = threading.Lock()
        self.latencies = array("f")
        self.ends = 0
        threading.Thread(target=self._receive_forever, name="pickup-listener", daemon=True).start()

    def _receive_forever(self) -> None:
        while True:
            data = self.socket.recv(65536)
            latencies = array("f")
            latencies.frombytes(data[HEADER.size :])
            (ends,) = HEADER.unpack_from(data)
            with self.lock:
                self.ends += ends
                self.latencies.extend(latencies)

    def take(self) -> tuple[int, array[float]]:
        with self.lock:
            ends, self.ends = self.ends, 0
            latencies, self.latencies = self.latencies, array("f")
        return ends, latencies
