"""A small proxy for disaggregated prefill in front of ``vllm serve`` processes running
``KvwireConnector``: an OpenAI client talks to it as to one server.

::

    python -m kvwire_vllm.proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

For each ``/v1/completions`` or ``/v1/chat/completions`` request it sends a copy to a prefill
(producer) server with ``max_tokens`` 1, no streaming and ``kv_transfer_params``
``{"do_remote_decode": true}``; the producer computes the prompt, keeps its blocks for the
consumer (``hold_s``) and answers the ``kv_transfer_params`` the consumer needs. The original
request then goes to a decode (consumer) server with those params; its answer (streamed or not)
goes back to the client. This is the protocol vLLM's own example proxy speaks with
``NixlConnector``, so that proxy works with kvwire as well. Servers are taken round-robin.

``GET /kvwire/source?server=N`` answers prefill server ``N``'s transceiver state (base64), got
from the server itself in ``kv_transfer_params`` of a one-token request with
``{"kvwire_want_source": true}``: what a client puts into a request's
``kv_transfer_params['kvwire_source']`` to pull a prompt from that server (the seed's
request-free pull), with no insecure serialization anywhere.

A prefill that fails (the server is down or answers an error) is logged and the request goes to a
decode server without params: it computes the prompt itself. Needs ``aiohttp`` (vLLM's
dependency)."""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from kvwire_vllm import trace

__all__ = ["Proxy", "main"]

log = logging.getLogger("kvwire_vllm.proxy")

_PATHS = ("/v1/completions", "/v1/chat/completions")


class Proxy:
    """Round-robin over ``prefill`` and ``decode`` base URLs (``http://host:port``)."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str], *, timeout_s: float = 600.0) -> None:
        if not prefill or not decode:
            raise ValueError("a proxy needs at least one prefill and one decode server")
        self.prefill = [u.rstrip("/") for u in prefill]
        self.decode = [u.rstrip("/") for u in decode]
        self._next_prefill = itertools.cycle(range(len(self.prefill)))
        self._next_decode = itertools.cycle(range(len(self.decode)))
        self.timeout_s = timeout_s
        self.handoffs = 0
        self.prefill_failures = 0

    def app(self) -> Any:
        from aiohttp import web

        app = web.Application(client_max_size=64 << 20)
        for path in _PATHS:
            app.router.add_post(path, self._handle)
        app.router.add_get("/kvwire/source", self._source)
        app.router.add_get("/health", self._health)
        app.router.add_get("/kvwire/stats", self._stats)
        app.cleanup_ctx.append(self._session)
        return app

    async def _session(self, app: Any) -> Any:
        import aiohttp

        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        yield
        await self.http.close()

    async def _health(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"prefill": self.prefill, "decode": self.decode})

    async def _stats(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"handoffs": self.handoffs, "prefill_failures": self.prefill_failures})

    async def _prefill(self, path: str, body: dict[str, Any], server: str) -> dict[str, Any] | None:
        """The producer's ``kv_transfer_params`` for ``body``, or None when the prefill failed."""
        first = dict(body)
        first.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True,
                                                                     "do_remote_prefill": False})
        first.pop("stream_options", None)
        if "max_completion_tokens" in first:
            first["max_completion_tokens"] = 1
        try:
            trace.event("proxy", "prefill_sent", server=server)
            async with self.http.post(server + path, json=first) as reply:
                answer = await reply.json(content_type=None)
                trace.event("proxy", "prefill_answered", status=reply.status)
                if reply.status != 200:
                    raise RuntimeError(f"HTTP {reply.status}: {str(answer)[:300]}")
        except Exception as exc:  # the decode server computes the prompt itself
            self.prefill_failures += 1
            log.warning("kvwire proxy: prefill at %s failed, decoding without it: %s", server, exc)
            return None
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        return params if isinstance(params, dict) else None

    async def _handle(self, request: Any) -> Any:
        from aiohttp import web

        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": "the request body is not JSON"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "the request body must be a JSON object"}, status=400)
        path = request.path
        params = await self._prefill(path, body, self.prefill[next(self._next_prefill)])
        second = dict(body)
        if params is not None:
            second["kv_transfer_params"] = params
            self.handoffs += 1
        else:
            second.pop("kv_transfer_params", None)
        server = self.decode[next(self._next_decode)]
        trace.event("proxy", "decode_sent", server=server)
        async with self.http.post(server + path, json=second) as reply:
            trace.event("proxy", "decode_answering", status=reply.status)
            if not body.get("stream"):
                data = await reply.read()
                return web.Response(body=data, status=reply.status, content_type="application/json")
            out = web.StreamResponse(status=reply.status, headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            async for chunk in reply.content.iter_any():
                trace.event("proxy", "decode_chunk", bytes=len(chunk))
                await out.write(chunk)
            await out.write_eof()
            return out

    async def _source(self, request: Any) -> Any:
        from aiohttp import web

        try:
            index = int(request.query.get("server", "0"))
            server = self.prefill[index]
        except (ValueError, IndexError):
            return web.json_response({"error": f"server must be 0..{len(self.prefill) - 1}"}, status=400)
        probe = {"prompt": [1, 2, 3], "max_tokens": 1, "kv_transfer_params": {"kvwire_want_source": True}}
        model = request.query.get("model")
        if model:
            probe["model"] = model
        else:
            async with self.http.get(server + "/v1/models") as reply:
                models = await reply.json(content_type=None)
            probe["model"] = models["data"][0]["id"]
        async with self.http.post(server + "/v1/completions", json=probe) as reply:
            answer = await reply.json(content_type=None)
        source = (answer.get("kv_transfer_params") or {}).get("kvwire_source") if isinstance(answer, dict) else None
        if not source:
            return web.json_response({"error": f"{server} answered no kvwire_source: its backend does not serve pulls",
                                      "answer": answer}, status=502)
        return web.json_response({"server": server, "kvwire_source": source})


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvwire_vllm.proxy", description=__doc__.split("\n")[0])
    ap.add_argument("--prefill", action="append", required=True, help="a prefill server's base URL (repeatable)")
    ap.add_argument("--decode", action="append", required=True, help="a decode server's base URL (repeatable)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        from aiohttp import web
    except ImportError:
        print("kvwire_vllm.proxy needs aiohttp (vLLM installs it): pip install aiohttp", file=sys.stderr)
        return 2
    proxy = Proxy(args.prefill, args.decode, timeout_s=args.timeout_s)
    print(json.dumps({"proxy": f"http://{args.host}:{args.port}", "prefill": proxy.prefill, "decode": proxy.decode}),
          flush=True)
    web.run_app(proxy.app(), host=args.host, port=args.port, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
