"""A router's view of vLLM's KV events: a ZMQ SUB socket bound on a loopback port (the engine's
publisher connects to it), each message decoded as vLLM's own subscriber decodes it
(``msgspec.msgpack.Decoder(type=KVEventBatch)``), and every event appended to a file as one
JSON line. Run with ``.venv-vllm/bin/python kv_events_listener.py PORT OUT``; it ends on SIGTERM.

A line: ``{"seq", "type", "medium", "block_hashes" (hex, or ints with int hashes), "parent",
"token_ids", "block_size"}``. A message that does not decode as vLLM's types is written as
``{"type": "undecodable", "error": ...}``, so a test sees it."""

from __future__ import annotations

import json
import signal
import sys
from typing import Any


def _hash(value: Any) -> Any:
    return value.hex() if isinstance(value, bytes) else value


def main() -> int:
    port, out = int(sys.argv[1]), sys.argv[2]
    import msgspec
    import zmq
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.bind(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    with open(out, "a") as f:
        f.write(json.dumps({"type": "listening", "port": port}) + "\n")
        f.flush()
        while not stop:
            if not sub.poll(100):
                continue
            _topic, seq, payload = sub.recv_multipart()
            try:
                batch = decoder.decode(payload)
            except msgspec.DecodeError as exc:
                f.write(json.dumps({"type": "undecodable", "error": str(exc)}) + "\n")
                f.flush()
                continue
            for event in batch.events:
                line: dict[str, Any] = {"seq": int.from_bytes(seq, "big"), "type": type(event).__name__}
                if isinstance(event, (BlockStored, BlockRemoved)):
                    line["medium"] = event.medium
                    line["block_hashes"] = [_hash(h) for h in event.block_hashes]
                if isinstance(event, BlockStored):
                    line.update(parent=_hash(event.parent_block_hash), token_ids=list(event.token_ids),
                                block_size=event.block_size)
                elif not isinstance(event, (BlockRemoved, AllBlocksCleared)):
                    line["type"] = f"unexpected {type(event).__name__}"
                f.write(json.dumps(line) + "\n")
            f.flush()
    sub.close(linger=0)
    ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
