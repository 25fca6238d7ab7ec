"""A TCP relay between two sites' servers (tests): the link a leafnode runs over,
with a one-way delay added to everything it carries, and a switch that cuts it
(every connection closed, new ones refused) and mends it."""

from __future__ import annotations

import asyncio
import time

from shared.natsd import free_port


class Relay:
    def __init__(self, target_port: int, delay_s: float = 0.0, port: int | None = None,
                 host: str = "127.0.0.1") -> None:
        self.host, self.target_port, self.delay_s = host, target_port, delay_s
        self.port = port or free_port()
        self.server: asyncio.Server | None = None
        self.links: set[asyncio.StreamWriter] = set()
        self.tasks: set[asyncio.Task] = set()  # one per connection carried
        self.accepted = 0  # connections carried since the start

    async def start(self) -> "Relay":
        self.server = await asyncio.start_server(self._serve, self.host, self.port)
        return self

    async def cut(self) -> None:
        """Close the listener and every connection: the link is down until mend()."""
        if self.server is not None:
            self.server.close()
            self.server = None
        for w in list(self.links):
            w.transport.abort()
        self.links.clear()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()

    async def mend(self) -> None:
        await self.start()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self.tasks.add(task)
        try:
            await self._carry(reader, writer)
        except asyncio.CancelledError:
            pass  # cut: the connection is gone
        finally:
            self.tasks.discard(task)

    async def _carry(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(self.host, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self.accepted += 1
        self.links |= {writer, up_w}
        await asyncio.gather(self._pipe(reader, up_w), self._pipe(up_r, writer),
                             return_exceptions=True)
        for w in (writer, up_w):
            self.links.discard(w)
            w.transport.abort()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy reader -> writer, each chunk `delay_s` after it was read, in order."""
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                due, data = item
                if (wait := due - time.monotonic()) > 0:
                    await asyncio.sleep(wait)  # the injected latency, not a synchronisation
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(deliver())
        try:
            while data := await reader.read(65536):
                queue.put_nowait((time.monotonic() + self.delay_s, data))
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
            writer.transport.abort()
