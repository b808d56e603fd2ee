"""A userspace TCP proxy that gives the faults a network gives a TCP path: delay, a slow link,
loss, a stall, a reset. Standard library only; run it as a script inside a simulated host
(``python faultproxy.py LISTEN_HOST:PORT TARGET_HOST:PORT``) and steer it with JSON lines on its
standard input; it prints ``{"listening": PORT}`` once it accepts connections, and one answer
line per command.

Commands (each replaces the setting it names, for both directions and every connection, new and
open; ``{}`` answers the current settings):

- ``{"delay_s": D}``: every chunk is forwarded ``D`` seconds after it was read (order kept).
- ``{"rate_bps": R}``: at most ``R`` bytes per second per direction (0: unlimited).
- ``{"loss": P, "rto_s": T}``: each chunk is, with probability ``P``, treated as a lost segment:
  the stream stops for ``T`` seconds (TCP's retransmission timeout) before it and everything
  after it go on. TCP never hands an application a hole, so that is what loss looks like above it.
- ``{"stall": true}``: nothing is forwarded and nothing more is read, so the senders' socket
  buffers fill (a black hole); ``false`` lets the held bytes go on.
- ``{"reset": true}``: every open connection is closed at once with RST (new ones still work).

A chunk is at most 64 KiB; at most 1 MiB waits in the proxy per direction, beyond which it stops
reading, so a stalled or slow path pushes back on the sender as a network would."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import struct
import sys
import time
from dataclasses import asdict, dataclass

CHUNK = 64 << 10
HELD_BYTES = 1 << 20


@dataclass
class Settings:
    delay_s: float = 0.0
    rate_bps: float = 0.0
    loss: float = 0.0
    rto_s: float = 0.2
    stall: bool = False
    seed: int = 0


class Proxy:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.settings = Settings()
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.changed = asyncio.Event()
        self.rng = random.Random(0)
        self.writers: set[asyncio.StreamWriter] = set()
        self.connections = 0
        self.bytes = 0

    def apply(self, command: dict[str, object]) -> dict[str, object]:
        s = self.settings
        values = {key: float(command[key]) for key in ("delay_s", "rate_bps", "loss", "rto_s")  # type: ignore[arg-type]
                  if key in command}
        for key, value in values.items():  # every value checked before any is applied
            if not value >= 0:
                raise ValueError(f"{key} must be >= 0, got {value}")
        if not 0 <= values.get("loss", s.loss) <= 1:
            raise ValueError(f"loss is a probability, got {values['loss']}")
        for key, value in values.items():
            setattr(s, key, value)
        if "seed" in command:
            s.seed = int(command["seed"])  # type: ignore[call-overload]
            self.rng.seed(s.seed)
        if "stall" in command:
            s.stall = bool(command["stall"])
            if s.stall:
                self.flowing.clear()
            else:
                self.flowing.set()
        if command.get("reset"):
            for writer in list(self.writers):
                sock = writer.get_extra_info("socket")
                if sock is not None:  # SO_LINGER 0: close() sends RST, not FIN
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
            self.writers.clear()
        self.changed.set()
        self.changed = asyncio.Event()
        return {**asdict(s), "connections": self.connections, "open": len(self.writers), "bytes": self.bytes}

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self.connections += 1
        self.writers |= {writer, up_writer}
        await asyncio.gather(self.pipe(reader, up_writer), self.pipe(up_reader, writer), return_exceptions=True)
        for w in (writer, up_writer):
            self.writers.discard(w)
            w.transport.abort()

    async def pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        held = [0]
        room = asyncio.Event()
        room.set()

        async def pump_in() -> None:
            while True:
                await self.flowing.wait()
                await room.wait()
                data = await reader.read(CHUNK)
                queue.put_nowait((time.monotonic() + self.settings.delay_s, data))
                if not data:
                    return
                held[0] += len(data)
                if held[0] >= HELD_BYTES:
                    room.clear()

        async def pump_out() -> None:
            free_at = time.monotonic()
            while True:
                due, data = await queue.get()
                if not data:
                    writer.write_eof() if writer.can_write_eof() else writer.close()
                    return
                s = self.settings
                if s.loss and self.rng.random() < s.loss:
                    due = max(due, time.monotonic() + s.rto_s)
                if s.rate_bps:
                    free_at = max(free_at, time.monotonic()) + len(data) / s.rate_bps
                    due = max(due, free_at)
                while (wait := due - time.monotonic()) > 0:
                    await asyncio.sleep(wait)  # the delay this proxy exists to add
                await self.flowing.wait()
                writer.write(data)
                await writer.drain()
                self.bytes += len(data)
                held[0] -= len(data)
                if held[0] < HELD_BYTES:
                    room.set()

        tasks = [asyncio.ensure_future(pump_in()), asyncio.ensure_future(pump_out())]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()


async def main(listen: tuple[str, int], target: tuple[str, int]) -> None:
    proxy = Proxy(target)
    server = await asyncio.start_server(proxy.handle, *listen, reuse_address=True)
    port = server.sockets[0].getsockname()[1]
    print(json.dumps({"listening": port}), flush=True)
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    while line := await stdin.readline():
        try:
            answer: dict[str, object] = {"ok": True, **proxy.apply(json.loads(line))}
        except (ValueError, TypeError) as exc:
            answer = {"ok": False, "message": str(exc)}
        print(json.dumps(answer), flush=True)
    server.close()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


if __name__ == "__main__":
    asyncio.run(main(_address(sys.argv[1]), _address(sys.argv[2])))
