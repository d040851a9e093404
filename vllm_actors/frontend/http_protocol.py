"""uvicorn's HTTP protocol with a deadline for request headers.

uvicorn closes idle keep-alive connections but never times out a request whose headers
arrive slowly, or a connection that opens and sends nothing: each such connection holds a
socket and a parser for as long as its client likes. Here every request's headers must be
complete within `HEADER_TIMEOUT_S` of the connection opening (or of the request's first
byte on a kept-alive connection); otherwise the connection is closed. Bodies have their own
deadline (`request_body.BODY_TIMEOUT_S`).

Headers are also bounded in size: httptools keeps a header's bytes until it ends, so a
request whose headers pass `MAX_HEADER_BYTES` (counted from the first chunk after the one
that began it) is answered 431 and closed instead of being buffered (64 MiB of one header
had held the event loop for seconds).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEADER_TIMEOUT_S = 20.0
MAX_HEADER_BYTES = 64 << 10
_TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; "
              b"charset=utf-8\r\ncontent-length: 32\r\nconnection: close\r\n\r\n"
              b"request headers are over 64 KiB\n")


class HeaderDeadlineProtocol(HttpToolsProtocol):
    header_timeout = HEADER_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_bytes = 0

    def data_received(self, data: bytes) -> None:
        awaiting = self._header_timer is not None
        super().data_received(data)
        if self._header_timer is None or self.transport.is_closing():
            return
        self._header_bytes += len(data) if awaiting else 0
        if self._header_bytes > MAX_HEADER_BYTES:
            self._disarm()
            self.transport.write(_TOO_LARGE)
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._header_timer is None:
            self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        self._header_bytes = 0
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()
