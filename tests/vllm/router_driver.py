"""The prefix-aware router's core (:mod:`kvwire_vllm.router`) in a process of its own, fed by
engines' KV event publishers, answering over stdin/stdout with JSON lines (pyzmq lives in vLLM's
venv, not in the tests'). Run with ``.venv-vllm/bin/python router_driver.py SPEC_JSON``; SPEC:
``{"block_size": n, "engines": {name: endpoint}}``. Requests: ``{"op": "held", "tokens": [...]}``
(each engine's leading blocks held), ``{"op": "choose", "tokens": [...], "load": {name: n},
"can_pull": bool}`` (the route), ``{"op": "quit"}``. Answers start with ``@@driver ``; the first
is ``{"ready": true}`` once every feed is subscribed."""

from __future__ import annotations

import json
import sys
import traceback

MARK = "@@driver "


def say(obj: object) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    spec = json.loads(sys.argv[1])
    from kvwire_vllm.router import EventFeed, PrefixIndex, choose

    index = PrefixIndex(int(spec["block_size"]))
    feeds = [EventFeed(index, name, endpoint) for name, endpoint in spec["engines"].items()]
    say({"ready": True})
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            req = json.loads(line)
            try:
                if req["op"] == "quit":
                    break
                if req["op"] == "held":
                    with index.lock:
                        say({"held": {name: index.held(name, req["tokens"]) for name in spec["engines"]}})
                elif req["op"] == "choose":
                    route = choose(index, req["tokens"], req["load"], can_pull=bool(req.get("can_pull")))
                    say({"engine": route.engine, "blocks": route.blocks, "pull_from": route.pull_from})
                else:
                    say({"error": f"unknown op {req['op']!r}"})
            except Exception as exc:
                say({"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
    finally:
        for feed in feeds:
            feed.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
