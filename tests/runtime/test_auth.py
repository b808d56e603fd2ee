"""Authenticated pulls: signed requests are served; unsigned, forged, stale, replayed and
not-allowed ones are refused with a reason and counted."""

from __future__ import annotations

import time

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.contract import Hint
from kvwire.contract.serving import PullRequest
from kvwire.holding import PullGuard, sign_pull

SECRET = b"s3cret"
NAMES = np.arange(64, dtype=np.uint8).reshape(2, 32)


def request(credentials: bytes = b"", names=NAMES, groups=(0, 1), peer="127.0.0.1:1") -> PullRequest:
    return PullRequest(Hint.of("ticket", id=1), groups, (128, 128), names, peer, credentials)


def test_signed_pull_is_served_once():
    guard = PullGuard(SECRET)
    cred = sign_pull(SECRET, "worker-B", (0, 1), NAMES)
    assert guard.check(request(cred)) is None
    assert "replay" in guard.check(request(cred))
    assert guard.refused == {"replayed": 1}


def test_refusals_say_why_and_are_counted():
    guard = PullGuard(SECRET)
    assert "requires signed pulls" in guard.check(request(b""))
    assert "signature" in guard.check(request(sign_pull(b"wrong", "w", (0, 1), NAMES)))
    other = NAMES.copy()
    other[1, 0] ^= 1
    assert "signature" in guard.check(request(sign_pull(SECRET, "w", (0, 1), other)))  # altered names
    assert "signature" in guard.check(request(sign_pull(SECRET, "w", (0,), NAMES)))    # altered groups
    old = time.time_ns() - int(120e9)
    assert "signed more than" in guard.check(request(sign_pull(SECRET, "w", (0, 1), NAMES, now_ns=old)))
    assert guard.refused == {"unauthenticated": 1, "forged": 3, "stale": 1}


def test_allowlist_uses_the_signed_name_when_signed_and_the_peer_otherwise():
    guard = PullGuard(SECRET, allowed={"worker-B"})
    assert guard.check(request(sign_pull(SECRET, "worker-B", (0, 1), NAMES))) is None
    assert "allowlist" in guard.check(request(sign_pull(SECRET, "worker-C", (0, 1), NAMES)))
    open_guard = PullGuard(None, allowed={"127.0.0.1:1"})
    assert open_guard.check(request()) is None
    assert "allowlist" in open_guard.check(request(peer="10.9.9.9:5"))


@settings(max_examples=300)
@given(cred=st.binary(max_size=200))
def test_garbage_credentials_never_crash(cred):
    reason = PullGuard(SECRET).check(request(cred))
    assert isinstance(reason, str) and reason
