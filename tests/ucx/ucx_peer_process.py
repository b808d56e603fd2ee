"""A kvwire-ucx end in its own process, driven over stdin/stdout with JSON lines (no pickle).

    python ucx_peer_process.py serve|ignore|kill-mid-pull|kill-on-request SLOT BLOCKS HELD
    python ucx_peer_process.py request SLOT BLOCKS ADDRESS_HEX

A serving end prints ``{"address": hex}`` and answers stdin commands ``pins`` (prints
``{"pins": n}``) and ``quit``. ``kill-mid-pull`` SIGKILLs itself once its first rows went out;
``kill-on-request`` as soon as a request arrives, before answering. A requesting end pulls
BLOCKS blocks from ADDRESS, prints ``{"fetching": true}`` and waits to be killed or told
``quit``. The backend's ``mode`` option comes from ``KVWIRE_UCX_TEST_MODE`` (default two-sided);
in the one-sided mode ``kill-mid-pull`` dies as soon as its answer went out (the requester reads
the rows, so none are ever sent)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

from ucx_holders import Pool, Requester, ReuseTree, ServingHolder, block_names, fill

from kvwire.holding import drain

GROUPS = (0, 1)


def say(**message: object) -> None:
    print(json.dumps(message), flush=True)


def main(argv: list[str]) -> int:
    from kvwire_ucx.backend import UcxBackend

    mode, slot, blocks = argv[0], int(argv[1]), int(argv[2])
    ucx_mode = os.environ.get("KVWIRE_UCX_TEST_MODE", "two-sided")
    backend = UcxBackend(timeout_s=20, grace_s=0.5, mode=ucx_mode)
    pool = Pool(GROUPS, blocks, slot)
    backend.register_regions(pool.regions)
    holder = None
    tree = ReuseTree()
    if mode == "request":
        address = bytes.fromhex(argv[3])
        Requester(backend, pool).fetch(address, block_names(blocks))
        say(fetching=True)
    else:
        held = int(argv[3])
        fill(pool, tree, block_names(blocks)[:held])

        def kill_when_sending(answer: object) -> None:
            def watch() -> None:
                while ucx_mode == "two-sided" and backend.stats().rows_sent < 1:
                    time.sleep(0.0005)
                os.kill(os.getpid(), signal.SIGKILL)

            threading.Thread(target=watch, daemon=True).start()

        serve_mode = {"serve": "serve", "ignore": "ignore", "kill-mid-pull": "serve", "kill-on-request": "ignore"}[mode]
        holder = ServingHolder(backend, pool, tree, mode=serve_mode,
                               on_publish=kill_when_sending if mode == "kill-mid-pull" else None)
        if mode == "kill-on-request":
            original = backend.incoming

            def incoming():  # the holder takes the request, then the process dies before answering
                requests = original()
                if requests:
                    os.kill(os.getpid(), signal.SIGKILL)
                return requests

            backend.incoming = incoming  # type: ignore[method-assign]
        say(address=backend.address().hex())
    for line in sys.stdin:
        command = line.strip()
        if command == "pins":
            say(pins=tree.pinned())
        elif command == "quit":
            break
    if holder is not None:
        holder.stop()
    drain(backend, 5.0, close=False)
    say(bye=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
