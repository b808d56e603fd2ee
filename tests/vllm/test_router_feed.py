"""The router's event feed against vLLM's own publisher (no engine): vLLM's ``ZmqEventPublisher``
publishes ``KVEventBatch`` es on an ``ipc://`` endpoint, :class:`kvwire_vllm.router.EventFeed`
subscribes, and the index and the route follow. Runs in vLLM's venv (pyzmq, vLLM's classes)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from engines import VLLM_PYTHON

pytestmark = [pytest.mark.usefixtures("vllm_venv"), pytest.mark.xdist_group("vllm")]

SCRIPT = r'''
import sys, time
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher
from kvwire_vllm.router import EventFeed, PrefixIndex, Route, choose

endpoint = "ipc://" + sys.argv[1]
B = 4
tokens = list(range(10, 10 + 3 * B + 1))
hashes = [b"h0", b"h1", b"h2"]
index = PrefixIndex(B)
publisher = ZmqEventPublisher(0, endpoint=endpoint)
feed = EventFeed(index, "e1", endpoint)

def until(what, check):
    deadline = time.monotonic() + 60
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)

def publish(*events):
    publisher.publish(KVEventBatch(ts=time.time(), events=list(events)))

try:
    # A subscriber joins some time after it connects (ZMQ's slow joiner): publish until one lands.
    until("the feed receiving", lambda: (publish(AllBlocksCleared()), time.sleep(0.05), feed.batches)[2] > 0)
    publish(BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens[:3 * B], block_size=B,
                        lora_id=None, medium="kvwire:files", lora_name=None))
    until("3 blocks indexed", lambda: index.held("e1", tokens) == 3)
    assert choose(index, tokens, {"e1": 0, "e2": 0}) == Route("e1", 3)
    publish(BlockRemoved(block_hashes=[b"h1"], medium="kvwire:files"))
    until("block 1 removed", lambda: index.held("e1", tokens) == 1)
    assert feed.gaps == 0
finally:
    feed.close()
    publisher.shutdown()
print("ok")
'''


def test_the_feed_indexes_what_vllms_publisher_sends(tmp_path: Path) -> None:
    done = subprocess.run([str(VLLM_PYTHON), "-c", SCRIPT, str(tmp_path / "events")], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-4000:]
