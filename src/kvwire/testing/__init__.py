"""kvwire's conformance kit, shipped in the wheel.

- ``kvwire.testing.suite``: the conformance suite (``pytest --pyargs kvwire.testing.suite
  --kvwire-backend NAME``), one test per contract rule and a stateful holder model;
- ``kvwire.testing.plugin``: the pytest plugin (``pytest11: kvwire``): options, fixtures, the
  report header;
- ``kvwire.testing.harness``: the :class:`~kvwire.testing.harness.Harness` API plugins implement
  (``kvwire.testing.stores.StoreHarness`` for plugins built on ``kvwire.blob.BlobBackend``);
- ``kvwire.testing.strategies``: hypothesis strategies for views, masks, hints, fault schedules;
- ``kvwire.testing.stateful``: the holder model, a ``RuleBasedStateMachine``;
- ``kvwire.testing.faults``: ``FaultyDriver``, fault injection for store drivers;
- ``kvwire.testing.runner``: ``run_conformance``, behind ``kvwire conformance NAME``.

Importing this package imports nothing else; the pytest plugin imports only pytest until the
suite runs."""
