"""The conformance suite: one test module per part of docs/contract.md, every test named after the
rule it checks (``test_M3_...``). Run it against an installed backend with::

    pytest --pyargs kvwire.testing.suite --kvwire-backend NAME

Every test takes the ``kvwire_harness`` fixture, which the ``kvwire`` pytest plugin
parametrizes over the backends selected; nothing here lives in a ``conftest.py``."""
