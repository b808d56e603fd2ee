"""Request-free pulls between kvwire workers on different simulated hosts over kvwire-ucx, in
both modes, and the faults a network gives them: a link pulled mid-pull and plugged back, the
serving host's processes killed mid-pull, a requester that stops reading, and a slow, lossy or
silent control path (a fault proxy in front of the serving end's listener).

After each: the pulls concluded within their deadline and the backend's grace, saying why; no
block is held with bytes other than the source's; nothing stays pinned, leased or in flight on
either host; and new pulls succeed without restarting the hosts that survived."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from hosts import ProxyProcess
from multihost import (
    Pair,
    check_bytes,
    check_nothing_held,
    check_result,
    listen_port,
    start_worker,
    state_via,
    ucx_options,
)

from kvwire.testing.require import backend_usable

pytestmark = pytest.mark.xdist_group("simulated-hosts")

TOKENS = 16 * 64      # 64 blocks of 64 KiB: 4 MiB per pull
SLOW_BITS = 16_000_000  # a 2 MB/s link: a pull takes about 2 s


@pytest.fixture(scope="module", params=["two-sided", "one-sided"])
def pair(request: pytest.FixtureRequest, network) -> Iterator[Pair]:
    backend_usable("ucx")  # skips, or fails when the run requires ucx
    mode = request.param
    if mode == "one-sided":
        from kvwire_ucx.nixl import nixl_problem

        if nixl_problem():
            pytest.skip(nixl_problem())
    h1, h2 = network[1], network[2]
    server = start_worker(h1, "ucx", ucx_options(h1, mode), name="A", blocks=1024, timeout_s=5)
    client = start_worker(h2, "ucx", ucx_options(h2, mode), name="B", blocks=1024, timeout_s=5)
    made = Pair(network, mode, server, client)
    try:
        yield made
    finally:
        for worker in (made.server, made.client):
            worker.proc.stop()
        network.unshape(h1)
        network.link_up(h1)


def fresh(pair: Pair, tokens: int = TOKENS) -> int:
    seed = pair.next_seed()
    pair.server.call("fill", seed=seed, tokens=tokens)
    return seed


def test_a_pull_across_hosts_moves_the_source_bytes_over_the_link(pair):
    seed = fresh(pair)
    sent_before = pair.network.link_bytes(pair.server.host)[1]
    result = pair.client.call("pull", seed=seed, tokens=TOKENS, source=pair.server.state)
    sent = pair.network.link_bytes(pair.server.host)[1] - sent_before
    assert result["status"] == "delivered" and result["blocks_moved"] == TOKENS // 16, result
    assert sent >= result["bytes_moved"] == 4 << 20        # the rows crossed the server's link
    assert check_result(result, pair.client, seed, TOKENS, deadline_s=5) == TOKENS // 16
    check_nothing_held(pair.server)
    check_nothing_held(pair.client)


def test_a_link_pulled_mid_pull_and_plugged_back(pair):
    seed = fresh(pair)
    net, server = pair.network, pair.server.host
    served = len(pair.server.proc.events("pull_served"))
    net.shape(server, SLOW_BITS)
    pending = pair.client.proc.begin("pull", seed=seed, tokens=TOKENS, source=pair.server.state, timeout_s=6)
    assert pair.server.proc.wait_event("pull_served", served + 1), "the serving host never answered the pull"
    with net.cable_pulled(server):
        assert not pending.done(), "the pull ended before the cable was pulled: the fault missed it"
        time.sleep(1.0)  # how long the cable stays out
    net.unshape(server)
    result = pending.result(30)
    check_result(result, pair.client, seed, TOKENS, deadline_s=6, causes={"deadline"})
    check_nothing_held(pair.server)
    check_nothing_held(pair.client)
    # The link is back and the client, never restarted, pulls again until one pull delivers. The
    # first may still wait behind the kernel's loss recovery on the transport's TCP socket (the
    # cancelled read's bytes queued there, retransmitted with a backed-off timer: seconds on this
    # link, measured up to 12 s); such a pull ends by its deadline saying so, holds nothing, and a
    # later one delivers.
    tries: list[dict] = []
    recovered_by = time.monotonic() + 45
    while True:
        again = pair.client.call("pull", seed=seed, tokens=TOKENS, source=pair.server.state, timeout_s=5)
        tries.append(again)
        if again["status"] in ("delivered", "skipped"):
            break
        check_result(again, pair.client, seed, TOKENS, deadline_s=5, causes={"deadline"})
        check_nothing_held(pair.client)
        assert time.monotonic() < recovered_by, f"no pull delivered within 45 s of the link's return: {tries}"
    assert again["cached_tokens"] == TOKENS, tries
    assert check_bytes(pair.client, seed, TOKENS) == TOKENS // 16
    check_nothing_held(pair.server)


def restart_server(pair) -> None:
    """A new serving process on the same host (a new state), in place of one killed or crashed."""
    host = pair.server.host
    pair.server.proc.stop()
    pair.server = start_worker(host, "ucx", ucx_options(host, pair.mode), name="A", blocks=1024, timeout_s=5)


def test_the_serving_host_killed_mid_pull(pair):
    seed = fresh(pair)
    net, server = pair.network, pair.server.host
    served = len(pair.server.proc.events("pull_served"))
    net.shape(server, SLOW_BITS)
    pending = pair.client.proc.begin("pull", seed=seed, tokens=TOKENS, source=pair.server.state, timeout_s=6)
    assert pair.server.proc.wait_event("pull_served", served + 1), "the serving host never answered the pull"
    # checked before the kill: once it is killed the pull may end at once (a one-sided read fails
    # with the peer's disconnect within milliseconds), which is the fault hitting it
    assert not pending.done(), f"the pull ended before the kill: the fault missed it: {pending.result(0)}"
    killed = server.kill_all()
    try:
        assert pair.server.proc.pid in killed, killed
        net.unshape(server)
        result = pending.result(30)
        # the kernel of the surviving namespace answers for the dead process: the peer is gone
        check_result(result, pair.client, seed, TOKENS, deadline_s=6, causes={"peer-gone"})
        assert result["status"] == "failed", result
        check_nothing_held(pair.client)
        later = pair.client.call("pull", seed=seed + 500, tokens=TOKENS, source=pair.server.state, timeout_s=3)
        assert later["status"] == "failed" and later["attempts"][0]["cause"] == "peer-gone", later
    finally:
        # the host comes back (a new process, a new state), whatever happened above: the module's
        # later tests need it; the client, never restarted, pulls from it
        net.unshape(server)
        restart_server(pair)
    pair.server.call("fill", seed=seed, tokens=TOKENS)
    result = pair.client.call("pull", seed=seed, tokens=TOKENS, source=pair.server.state)
    assert result["status"] == "delivered" and result["cached_tokens"] == TOKENS, result
    assert check_bytes(pair.client, seed, TOKENS) == TOKENS // 16
    check_nothing_held(pair.server)
    check_nothing_held(pair.client)


def test_a_requester_that_stops_reading_does_not_hold_the_serving_host(pair):
    tokens = 16 * 512  # 32 MiB: more than both sockets' buffers hold
    seed = fresh(pair, tokens)
    served = len(pair.server.proc.events("pull_served"))
    pending = pair.client.proc.begin("pull", seed=seed, tokens=tokens, source=pair.server.state, timeout_s=3)
    assert pair.server.proc.wait_event("pull_served", served + 1), "the serving host never answered the pull"
    pair.client.proc.freeze()
    try:
        # the serving end's answer ends at the requester's deadline and its grace: pins come back
        acc = check_nothing_held(pair.server, settle_s=3 + 5)
        assert acc["counters"]["pulls_served"] >= 1
    finally:
        pair.client.proc.thaw()
    try:
        result = pending.result(30)
        assert result["status"] in ("failed", "delivered"), result
        check_bytes(pair.client, seed, tokens)  # the stopped end is no survivor: only its bytes are checked
        check_nothing_held(pair.client)
        again = pair.client.call("pull", seed=seed, tokens=tokens, source=pair.server.state, timeout_s=10)
        assert again["status"] in ("delivered", "skipped") and again["cached_tokens"] == tokens, again
        assert check_bytes(pair.client, seed, tokens) == tokens // 16
    finally:
        # UCX's TCP transport can crash the serving process once it closed this stalled peer's
        # endpoint and the peer reads again (backends/ucx/README.md, "Not worked around"): this
        # test then fails above, and the module's later tests get a serving host again
        if not pair.server.proc.alive():
            restart_server(pair)


def test_a_slow_lossy_or_silent_control_path(pair):
    server = pair.server.host
    port = listen_port(pair.server.state)
    alias = server.add_address(100 + ("two-sided", "one-sided").index(pair.mode))
    proxy = ProxyProcess(server, f"{alias}:{port}", f"{server.address}:{port}")
    try:
        via = state_via(pair.server.state, alias, port)
        for faults in ({"delay_s": 0.05}, {"loss": 0.3, "rto_s": 0.2, "seed": 7}, {"rate_bps": 20_000}):
            proxy.set(**faults)
            seed = fresh(pair)
            result = pair.client.call("pull", seed=seed, tokens=TOKENS, source=via, timeout_s=5)
            assert result["status"] == "delivered" and result["cached_tokens"] == TOKENS, (faults, result)
            check_result(result, pair.client, seed, TOKENS, deadline_s=5)
            proxy.heal()
        assert proxy.set()["bytes"] > 0  # the control messages went through the proxy
        proxy.set(stall=True)
        seed = fresh(pair)
        result = pair.client.call("pull", seed=seed, tokens=TOKENS, source=via, timeout_s=2)
        assert result["status"] == "failed", result
        check_result(result, pair.client, seed, TOKENS, deadline_s=2, causes={"deadline"})
        check_nothing_held(pair.client)
        proxy.heal()
        check_nothing_held(pair.server)
        result = pair.client.call("pull", seed=seed, tokens=TOKENS, source=via, timeout_s=5)
        assert result["status"] == "delivered" and result["cached_tokens"] == TOKENS, result
        assert check_bytes(pair.client, seed, TOKENS) == TOKENS // 16
        check_nothing_held(pair.server)
        check_nothing_held(pair.client)
    finally:
        proxy.stop()
