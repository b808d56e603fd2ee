"""A prefix-aware router in front of ``vllm serve`` processes running ``KvwireConnector`` (an
example of :mod:`kvwire_vllm.router`, not a service framework): an OpenAI client talks to it as to
one server.

::

    python examples/vllm_prefix_router.py --port 8000 --pull \\
        --engine http://127.0.0.1:8100=tcp://127.0.0.1:5557 \\
        --engine http://127.0.0.1:8101=tcp://127.0.0.1:5558 \\
        --engine http://127.0.0.1:8102=tcp://127.0.0.1:5559

Each ``--engine`` is a server's URL and the endpoint its KV events are published on (the server
runs with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557"}'``). A ``/v1/completions`` request goes to the engine holding the
longest prefix of its prompt; with ``--pull`` (engines over kvwire-ucx, which serve pulls), to the
least loaded engine with the holder's transceiver state in ``kv_transfer_params["kvwire_source"]``
when the holder is much busier, so that engine pulls the prefix first. The state is asked of the
holder once, in ``kv_transfer_params`` of a one-token request with ``{"kvwire_want_source":
true}``. Load is the requests this router has in flight per engine. A prompt of text is tokenized
by the engine's ``/tokenize``. Answers carry the route in the ``x-kvwire-route`` header. Needs
``aiohttp`` and ``pyzmq`` (vLLM's dependencies): run it with vLLM's Python."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from kvwire_vllm.router import EventFeed, PrefixIndex, Route, choose

log = logging.getLogger("vllm_prefix_router")


class Router:
    def __init__(self, engines: dict[str, str], block_size: int, pull: bool) -> None:
        self.urls = {url.rstrip("/"): events for url, events in engines.items()}
        self.index = PrefixIndex(block_size)
        self.feeds = [EventFeed(self.index, url, events) for url, events in self.urls.items()]
        self.load = {url: 0 for url in self.urls}
        self.pull = pull
        self.states: dict[str, str] = {}

    async def tokens(self, session: Any, url: str, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        async with session.post(url + "/tokenize", json={"model": body.get("model"), "prompt": prompt}) as reply:
            return list((await reply.json()).get("tokens") or [])

    async def state(self, session: Any, url: str, model: str) -> str:
        if url not in self.states:
            body = {"model": model, "prompt": [1], "max_tokens": 1, "kv_transfer_params": {"kvwire_want_source": True}}
            async with session.post(url + "/v1/completions", json=body) as reply:
                self.states[url] = (await reply.json())["kv_transfer_params"]["kvwire_source"]
        return self.states[url]

    def app(self) -> Any:
        from aiohttp import ClientSession, web

        async def complete(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            async with ClientSession() as session:
                route: Route = choose(self.index, await self.tokens(session, next(iter(self.urls)), body), self.load,
                                      can_pull=self.pull)
                if route.pull_from is not None:
                    params = dict(body.get("kv_transfer_params") or {})
                    params["kvwire_source"] = await self.state(session, route.pull_from, str(body.get("model")))
                    body["kv_transfer_params"] = params
                log.info("route: %s", route)
                self.load[route.engine] += 1
                try:
                    async with session.post(route.engine + request.path, json=body) as reply:
                        out = web.StreamResponse(status=reply.status, headers={
                            "Content-Type": reply.headers.get("Content-Type", "application/json"),
                            "x-kvwire-route": json.dumps({"engine": route.engine, "blocks": route.blocks,
                                                          "pull_from": route.pull_from})})
                        await out.prepare(request)
                        async for chunk in reply.content.iter_any():
                            await out.write(chunk)
                        await out.write_eof()
                        return out
                finally:
                    self.load[route.engine] -= 1

        async def health(request: web.Request) -> web.Response:
            return web.json_response({"engines": self.load})

        app = web.Application()
        app.router.add_post("/v1/completions", complete)
        app.router.add_get("/health", health)
        return app

    def close(self) -> None:
        for feed in self.feeds:
            feed.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", action="append", required=True, help="URL=EVENTS_ENDPOINT (repeat)")
    parser.add_argument("--block-size", type=int, default=16, help="the engines' block size (default 16)")
    parser.add_argument("--pull", action="store_true", help="engines serve pulls (kvwire-ucx)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    engines = dict(e.split("=", 1) for e in args.engine)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from aiohttp import web

    router = Router(engines, args.block_size, args.pull)
    try:
        web.run_app(router.app(), host=args.host, port=args.port)
    finally:
        router.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
