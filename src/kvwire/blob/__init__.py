"""The blob backend family: moving rows to and from a store of named, immutable objects.

:class:`BlobBackend` keeps the whole contract once; a store plugin supplies only a
:class:`StoreDriver` (the in-memory store, Mooncake, ...), declares
:func:`blob_capabilities`, and lists :data:`STORE_OPTIONS` (``timeout_s``, ``max_in_flight``,
``namespace``, declared once) beside its own options."""

from kvwire.blob.backend import STORE_HINT_KIND, BlobBackend, BlobRegistration, blob_capabilities
from kvwire.blob.driver import BatchResult, KeyStatus, StoreDriver, call_deadline
from kvwire.blob.keys import KEY_PREFIX, block_keys, check_namespace, store_keys
from kvwire.blob.options import STORE_OPTIONS, store_options

__all__ = [
    "BlobBackend",
    "BlobRegistration",
    "blob_capabilities",
    "STORE_HINT_KIND",
    "StoreDriver",
    "KeyStatus",
    "BatchResult",
    "call_deadline",
    "KEY_PREFIX",
    "check_namespace",
    "store_keys",
    "block_keys",
    "STORE_OPTIONS",
    "store_options",
]
