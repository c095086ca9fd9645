"""A fault-injecting TCP proxy in front of the test PostgreSQL's unix socket.

A unix socket never loses a reply, so tests put this proxy between a worker and the server to get
what a real network does: a statement the server committed whose reply never reaches the client
(an "ambiguous commit"), connections cut mid-session, and a link that hangs without closing. It
listens on 127.0.0.1, so a worker process reaches it through an ordinary DATABASE_URL::

    upstream = test_database_url()
    with PgProxy.from_database_url(upstream) as proxy:
        worker = start_manage(log, "run_worker", DATABASE_URL=proxy.url_for(upstream))
        proxy.drop_reply_after(b"UPDATE tasks_task AS t SET").fired.wait(10)

Bytes are forwarded unchanged. Both directions are split into protocol messages (a type byte and
an int32 length, after the untyped startup packets) so that faults act on message boundaries: the
reply to a statement is recognised by counting ReadyForQuery messages against the Query/Sync
messages that ask for them, not by searching for bytes that a DataRow could contain as well.
"""

from __future__ import annotations

import queue
import selectors
import socket
import struct
import threading
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Literal, TypeVar
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

# Request codes of the untyped packets a client may send before its StartupMessage.
CANCEL_REQUEST = 80877102
SSL_REQUEST = 80877103
GSSENC_REQUEST = 80877104
# Client messages answered by exactly one ReadyForQuery each: a simple Query, the Sync closing an
# extended-protocol batch, a FunctionCall (the StartupMessage is answered by the first one too).
ANSWERED_BY_READY = frozenset({b"Q", b"S", b"F"})
# Stop reading a side while this much is waiting to be written to the other one.
BUFFER_LIMIT = 1 << 20
CALL_TIMEOUT = 10.0

# Tags of what _Stream yields besides typed messages (whose tag is their type byte).
STARTUP = b"startup"  # an untyped packet: SSLRequest, GSSENCRequest, CancelRequest, StartupMessage
ANSWER = b"answer"  # the server's one-byte answer to an SSLRequest or GSSENCRequest
OPAQUE = b"opaque"  # bytes after encryption was accepted, or after a malformed header

_Message = tuple[bytes, bytes]  # (tag, the message's bytes as they travel)
T = TypeVar("T")

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is 3.11+


@dataclass(eq=False)
class Fault:
    """A fault armed on the proxy; it fires once, on the first client message containing ``pattern``."""

    kind: Literal["drop_reply", "freeze"]
    pattern: bytes
    deliver: bool = False
    #: The client sent a message containing the pattern.
    matched: threading.Event = field(default_factory=threading.Event)
    #: drop_reply: the reply was swallowed and the connection closed. freeze: traffic has stopped.
    fired: threading.Event = field(default_factory=threading.Event)
    #: The client message that matched.
    message: bytes | None = None
    #: drop_reply: the transaction status of the swallowed ReadyForQuery. b"I" means no transaction
    #: is open, so the statement committed (autocommit); b"T" means the disconnect rolls it back.
    status: bytes | None = None


class _Stream:
    """Splits one direction of a connection into protocol messages."""

    def __init__(self, *, startup: bool) -> None:
        self._buffer = bytearray()
        #: Client side, before the StartupMessage: packets have a length but no type byte.
        self.startup = startup
        #: Server side: one-byte answers owed to SSLRequest/GSSENCRequest packets.
        self.answers_due = 0
        #: Encrypted (or unparseable) from here on: forwarded as it comes.
        self.opaque = False

    def feed(self, data: bytes) -> list[_Message]:
        buffer = self._buffer
        buffer += data
        messages: list[_Message] = []
        start = 0
        while start < len(buffer):
            if self.opaque:
                messages.append((OPAQUE, bytes(buffer[start:])))
                start = len(buffer)
                break
            if self.answers_due:
                self.answers_due -= 1
                answer = bytes(buffer[start : start + 1])
                # 'S' or 'G' accepts encryption: a TLS or GSSAPI handshake follows, not messages.
                self.opaque = answer != b"N"
                messages.append((ANSWER, answer))
                start += 1
                continue
            header = 4 if self.startup else 5
            if len(buffer) - start < header:
                break
            (length,) = struct.unpack_from("!i", buffer, start + header - 4)
            if length < 4:
                self.opaque = True
                continue
            end = start + header - 4 + length
            if end > len(buffer):
                break
            raw = bytes(buffer[start:end])
            messages.append((STARTUP if self.startup else raw[:1], raw))
            start = end
        del buffer[:start]
        return messages

    def rest(self) -> bytes:
        """What is left of an incomplete message (the peer closed in the middle of it)."""
        rest = bytes(self._buffer)
        self._buffer.clear()
        return rest


@dataclass(eq=False)
class _Link:
    """One client connection and the proxy's own connection to the server for it."""

    client: socket.socket
    server: socket.socket
    to_client: bytearray = field(default_factory=bytearray)
    to_server: bytearray = field(default_factory=bytearray)
    from_client: _Stream = field(default_factory=lambda: _Stream(startup=True))
    from_server: _Stream = field(default_factory=lambda: _Stream(startup=False))
    startup_packet: bytes = b""
    last_statement: bytes = b""
    #: Statements the client prepared on this connection (a named Parse): name -> the Parse message.
    prepared: dict[bytes, bytes] = field(default_factory=dict)
    requests: int = 0  # client messages sent that are answered by a ReadyForQuery
    ready: int = 0  # ReadyForQuery messages received
    dropping: Fault | None = None
    drop_at: int = 0  # the ordinal of the ReadyForQuery that ends the reply to swallow
    freezing: Fault | None = None  # a freeze that engages after the next request-ending message
    frozen: Fault | None = None
    held_from_client: list[_Message] = field(default_factory=list)
    held_from_server: list[_Message] = field(default_factory=list)
    closing: bool = False
    closed: bool = False


class PgProxy:
    """A TCP proxy to a PostgreSQL unix socket, forwarding faithfully until a fault is armed.

    ``socket_path`` is the socket itself or its directory (then ``.s.PGSQL.<server_port>`` in it).
    One background thread serves every connection with ``selectors``.
    """

    def __init__(self, socket_path: str | Path, *, server_port: int = 5432) -> None:
        path = Path(socket_path)
        self.socket_path = path / f".s.PGSQL.{server_port}" if path.is_dir() else path
        self._listener: socket.socket | None = None
        self._selector: selectors.BaseSelector | None = None
        self._thread: threading.Thread | None = None
        self._waker: tuple[socket.socket, socket.socket] | None = None
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._links: set[_Link] = set()
        self._armed: list[Fault] = []
        self._armed_lock = threading.Lock()
        self._counted: dict[bytes, int] = {}  # pattern -> Query/Parse messages seen containing it
        self._stopping = False
        self._crash: BaseException | None = None

    @classmethod
    def from_database_url(cls, database_url: str) -> PgProxy:
        """A proxy for the server of a unix-socket DATABASE_URL (socket directory in ``?host=``)."""
        parts = urlsplit(database_url)
        params = dict(parse_qsl(parts.query))
        host = params.get("host") or unquote(parts.netloc.rpartition("@")[2].partition(":")[0])
        if not host.startswith("/"):
            raise ValueError(f"{database_url!r} does not name a unix socket directory")
        return cls(host, server_port=int(params.get("port") or parts.port or 5432))

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> Self:
        if self._thread is not None:
            raise RuntimeError("the proxy was already started")
        listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        listener.setblocking(False)
        waker = socket.socketpair()
        for end in waker:
            end.setblocking(False)
        selector = selectors.DefaultSelector()
        selector.register(listener, selectors.EVENT_READ, self._accept)
        selector.register(waker[0], selectors.EVENT_READ, self._run_calls)
        self._listener, self._waker, self._selector = listener, waker, selector
        self._thread = threading.Thread(target=self._serve, name=f"pgproxy:{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Close every connection and the listener; re-raises what crashed the proxy thread, if anything."""
        thread = self._thread
        if thread is None or self._stopping:
            return
        self._stopping = True
        self._wake()
        thread.join(CALL_TIMEOUT)
        if thread.is_alive():
            raise RuntimeError("the proxy thread did not stop")
        if self._crash is not None:
            raise RuntimeError("the proxy thread crashed") from self._crash

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._listener is None:
            raise RuntimeError("the proxy is not started")
        port: int = self._listener.getsockname()[1]
        return port

    @property
    def connection_count(self) -> int:
        """Client connections currently open through the proxy."""
        return len(self._links)

    def url_for(self, database_url: str) -> str:
        """``database_url`` (same user, password, database and options) through this proxy."""
        parts = urlsplit(database_url)
        userinfo, _, _ = parts.netloc.rpartition("@")
        netloc = f"{userinfo}@127.0.0.1:{self.port}" if userinfo else f"127.0.0.1:{self.port}"
        # TLS is refused on the unix socket anyway; disabling it spares a round trip per connection.
        query = [(k, v) for k, v in parse_qsl(parts.query) if k not in {"host", "hostaddr", "port", "sslmode"}]
        query.append(("sslmode", "disable"))
        return urlunsplit((parts.scheme, netloc, parts.path, urlencode(query, quote_via=quote), ""))

    # -- faults -------------------------------------------------------------------------------

    def drop_reply_after(self, pattern: bytes) -> Fault:
        """On the first client message containing ``pattern``: forward it, wait for the server to
        finish answering it (ReadyForQuery), swallow that whole answer and cut the connection."""
        return self._arm(Fault("drop_reply", pattern))

    def freeze(self, pattern: bytes, *, deliver: bool = False) -> Fault:
        """On the first client message containing ``pattern``, stop that connection's traffic both
        ways, sockets left open, until ``thaw()``. The message is held back too, unless ``deliver``:
        then the server gets the statement (and runs it) and only its answer is held."""
        return self._arm(Fault("freeze", pattern, deliver=deliver))

    def thaw(self) -> int:
        """Resume every frozen connection, and disarm freezes that have not fired; returns how many resumed."""
        with self._armed_lock:
            self._armed = [fault for fault in self._armed if fault.kind != "freeze"]
        return self._call(self._thaw_all) if self._running() else 0

    def count(self, pattern: bytes) -> int:
        """How many Query/Parse messages clients sent containing ``pattern`` since it was first asked
        about (the first call starts counting and returns 0)."""
        with self._armed_lock:
            return self._counted.setdefault(pattern, 0)

    def disarm(self) -> int:
        """Forget the faults that have not fired; returns how many."""
        with self._armed_lock:
            count = len(self._armed)
            self._armed = []
        return count

    def kill_connections(self, match: bytes | None = None) -> int:
        """Reset every open client connection (RST, and close its server side) and return how many.

        With ``match``, only those whose startup packet (user, database, application_name) or
        latest Query/Parse message contains it.
        """

        def kill() -> int:
            victims = [
                link
                for link in self._links
                if match is None or match in link.startup_packet or match in link.last_statement
            ]
            for link in victims:
                self._abort(link)
            return len(victims)

        return self._call(kill) if self._running() else 0

    def _arm(self, fault: Fault) -> Fault:
        with self._armed_lock:
            self._armed.append(fault)
        return fault

    def _claim(self, message: bytes) -> Fault | None:
        if not self._armed:
            return None
        with self._armed_lock:
            for fault in self._armed:
                if fault.pattern in message:
                    self._armed.remove(fault)
                    fault.message = message
                    fault.matched.set()
                    return fault
        return None

    # -- the proxy thread ---------------------------------------------------------------------

    def _running(self) -> bool:
        if self._crash is not None:
            raise RuntimeError("the proxy thread crashed") from self._crash
        return self._thread is not None and self._thread.is_alive()

    def _call(self, function: Callable[[], T]) -> T:
        """Run ``function`` on the proxy thread, which owns every socket, and return its result."""
        results: list[T] = []
        errors: list[BaseException] = []
        done = threading.Event()

        def run() -> None:
            try:
                results.append(function())
            except BaseException as exc:
                errors.append(exc)
            finally:
                done.set()

        self._calls.put(run)
        self._wake()
        if not done.wait(CALL_TIMEOUT):
            raise RuntimeError("the proxy thread did not answer") from self._crash
        if errors:
            raise errors[0]
        return results[0]

    def _wake(self) -> None:
        if self._waker is not None:
            # Full: the thread has wake-ups pending already. Closed: it has stopped.
            with suppress(OSError):
                self._waker[1].send(b"\0")

    def _serve(self) -> None:
        assert self._selector is not None
        try:
            while not self._stopping:
                for key, events in self._selector.select():
                    if isinstance(key.data, _Link):
                        self._on_event(key.data, key.fileobj is key.data.client, events)
                    else:
                        key.data()
        except BaseException as exc:
            self._crash = exc
        finally:
            for link in list(self._links):
                self._abort(link)
            self._run_calls()
            self._selector.close()
            for sock in (self._listener, *(self._waker or ())):
                if sock is not None:
                    sock.close()

    def _run_calls(self) -> None:
        assert self._waker is not None
        try:
            while self._waker[0].recv(4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                return
            call()

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                client, _ = self._listener.accept()
            except BlockingIOError:
                return
            client.setblocking(False)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                server.connect(str(self.socket_path))
            except OSError:
                server.close()
                _reset(client)
                continue
            server.setblocking(False)
            link = _Link(client, server)
            self._links.add(link)
            self._update(link)

    def _on_event(self, link: _Link, from_client: bool, events: int) -> None:
        try:
            if events & selectors.EVENT_WRITE:
                self._flush(link)
            if events & selectors.EVENT_READ and not link.closed:
                self._receive(link, from_client)
                if not link.closed:
                    self._flush(link)
        except OSError:
            self._abort(link)
        self._update(link)

    def _receive(self, link: _Link, from_client: bool) -> None:
        sock, stream = (link.client, link.from_client) if from_client else (link.server, link.from_server)
        data = sock.recv(65536)
        if data:
            if from_client:
                self._from_client(link, stream.feed(data))
            else:
                self._from_server(link, stream.feed(data))
            return
        # The peer closed: pass on the rest it sent, and close the other side once that is written.
        rest = stream.rest()
        if rest and link.dropping is None:
            (link.to_server if from_client else link.to_client).extend(rest)
        link.closing = True

    def _from_client(self, link: _Link, messages: list[_Message]) -> None:
        for tag, raw in messages:
            if link.closed:
                return
            if link.frozen is not None:
                link.held_from_client.append((tag, raw))
                continue
            if tag == STARTUP:
                self._on_startup_packet(link, raw)
            elif tag != OPAQUE:
                statement = _statement_run(link, tag, raw)
                if statement is not None:
                    link.last_statement = statement
                    if self._counted:
                        with self._armed_lock:
                            for pattern in self._counted:
                                self._counted[pattern] += pattern in statement
                fault = None if link.dropping or link.freezing or statement is None else self._claim(statement)
                if fault is not None and fault.kind == "drop_reply":
                    link.dropping, link.drop_at = fault, link.requests + 1
                elif fault is not None and fault.deliver:
                    link.freezing = fault
                elif fault is not None:
                    self._freeze_link(link, fault)
                    link.held_from_client.append((tag, raw))
                    continue
                if tag in ANSWERED_BY_READY:
                    link.requests += 1
            link.to_server += raw
            if link.freezing is not None and tag in ANSWERED_BY_READY:
                self._freeze_link(link, link.freezing)

    def _on_startup_packet(self, link: _Link, raw: bytes) -> None:
        (code,) = struct.unpack_from("!i", raw, 4) if len(raw) >= 8 else (0,)
        if code in (SSL_REQUEST, GSSENC_REQUEST):
            link.from_server.answers_due += 1
        elif code != CANCEL_REQUEST:
            link.from_client.startup = False
            link.startup_packet = raw
            link.requests += 1

    def _from_server(self, link: _Link, messages: list[_Message]) -> None:
        for tag, raw in messages:
            if link.closed:
                return
            if link.frozen is not None:
                link.held_from_server.append((tag, raw))
                continue
            if tag == ANSWER and raw != b"N":
                link.from_client.opaque = True
            dropping = link.dropping
            if dropping is not None and link.ready >= link.drop_at - 1:
                # The answer to the statement (and anything after it): never reaches the client.
                if tag == b"Z":
                    link.ready += 1
                    if link.ready == link.drop_at:
                        # Fired before the sockets close, so that a client that has seen its error
                        # finds the fault fired, and after the link is gone from connection_count.
                        self._links.discard(link)
                        dropping.status = raw[5:6]
                        dropping.fired.set()
                        self._abort(link)
                        return
                continue
            if tag == b"Z":
                link.ready += 1
            link.to_client += raw

    def _freeze_link(self, link: _Link, fault: Fault) -> None:
        link.freezing = None
        link.frozen = fault
        fault.fired.set()

    def _thaw_all(self) -> int:
        thawed = [link for link in self._links if link.frozen is not None or link.freezing is not None]
        for link in thawed:
            link.frozen = link.freezing = None
            from_client, link.held_from_client = link.held_from_client, []
            from_server, link.held_from_server = link.held_from_server, []
            self._from_client(link, from_client)
            self._from_server(link, from_server)
            try:
                self._flush(link)
            except OSError:
                self._abort(link)
            self._update(link)
        return len(thawed)

    def _flush(self, link: _Link) -> None:
        if link.closed:
            return
        for sock, buffer in ((link.client, link.to_client), (link.server, link.to_server)):
            while buffer:
                try:
                    sent = sock.send(buffer)
                except BlockingIOError:
                    break
                del buffer[:sent]

    def _update(self, link: _Link) -> None:
        """Register for what the link can do now: read unless frozen, closing or backed up; write what is due."""
        if link.closed:
            return
        if link.closing and not link.to_client and not link.to_server:
            self._abort(link)
            return
        readable = link.frozen is None and not link.closing
        for sock, outgoing, incoming in (
            (link.client, link.to_client, link.to_server),
            (link.server, link.to_server, link.to_client),
        ):
            events = selectors.EVENT_WRITE if outgoing else 0
            if readable and len(incoming) < BUFFER_LIMIT:
                events |= selectors.EVENT_READ
            self._register(sock, events, link)

    def _register(self, sock: socket.socket, events: int, link: _Link) -> None:
        assert self._selector is not None
        try:
            current = self._selector.get_key(sock).events
        except KeyError:
            current = 0
        if events == current:
            return
        if not events:
            self._selector.unregister(sock)
        elif not current:
            self._selector.register(sock, events, link)
        else:
            self._selector.modify(sock, events, link)

    def _abort(self, link: _Link) -> None:
        """Close both sides at once, the client side with a reset."""
        if link.closed:
            return
        link.closed = True
        self._links.discard(link)
        for sock in (link.client, link.server):
            self._register(sock, 0, link)
        _reset(link.client)
        link.server.close()


def _cstring(raw: bytes, at: int) -> tuple[bytes, int]:
    end = raw.index(b"\0", at)
    return raw[at:end], end + 1


def _statement_run(link: _Link, tag: bytes, raw: bytes) -> bytes | None:
    """The statement a client message runs, as the bytes faults and counts look for (its text and
    its parameters); None for a message that runs none. A simple Query carries both. In the extended
    protocol a Parse only prepares (a named statement's text travels once; the unnamed one's with
    each run) and a Bind runs it with its parameters: the Bind is matched, as the Parse's bytes
    followed by its own."""
    try:
        if tag == b"Q":
            return raw
        if tag == b"P":
            name, _ = _cstring(raw, 5)
            link.prepared[name] = raw
            return None
        if tag == b"B":
            _portal, at = _cstring(raw, 5)
            name, _ = _cstring(raw, at)
            parse = link.prepared.get(name)
            return None if parse is None else parse + raw
    except ValueError:  # a malformed message: forwarded as it is, matched by nothing
        return None
    return None


def _reset(sock: socket.socket) -> None:
    """Close a TCP socket with an RST rather than a FIN, as a crashed peer or a middlebox would."""
    with suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
