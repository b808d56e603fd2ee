"""A worker in its own process, for the two-process tests: it runs ``generate`` on the prompts it
is given, prints its transceiver state (hex) and its logits' checksum, then serves pulls until
its standard input closes or says ``quit``, printing its pin count on ``pins``."""

from __future__ import annotations

import json
import sys

import numpy as np


def main() -> None:
    spec = json.loads(sys.argv[1])
    from kvwire.runtime import ModelConfig, Worker

    model = ModelConfig(**spec["model"])
    worker = Worker(model, backend=spec["backend"], num_blocks=spec["blocks"], name=spec["name"],
                    timeout_s=10, pull_secret=spec.get("secret"))
    for p in spec["prompts"]:
        worker.generate(np.asarray(p, dtype=np.int64), max_tokens=1)
    print(json.dumps({"state": worker.transceiver_state().hex()}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "pins":
            print(json.dumps({"pins": worker.pins(), "served": worker.counters.pulls_served}), flush=True)
        elif cmd == "quit":
            break
    worker.close()


if __name__ == "__main__":
    main()
