"""kvguard: memory safety for paged KV caches.

Every KV page carries its owner request, tenant and generation; every token slot whether its
current owner wrote it; every attention read is checked against that. A Rust core (this package
binds it; it adds no semantics of its own).

Quick start::

    import numpy as np, kvguard
    table = kvguard.OwnershipTable(kvguard.PoolConfig(1024, 16, 4096, reserved=[0]))
    table.admit("cmpl-a", "acme", 40, 100)
    pages = [r.page for r in table.allocate("cmpl-a", 3)]
    table.record_write_tokens("cmpl-a", pages, 0, 40)
    bt = np.zeros((8, 16), dtype=np.int32); bt[0, :3] = pages
    verdict = table.verify_step(["cmpl-a"], bt, np.array([40], dtype=np.int32))
    assert verdict.clean

Names: check_* is pure, verify_* is judged under the pool's policy ("enforce" or "report").
Violations are sent to the ``logging`` logger ``kvguard`` (level WARNING).
"""

from ._kvguard import (
    PADDING_SLOT,
    VIOLATION_KINDS,
    Accepted,
    ConfigError,
    DeviceError,
    DeviceGuard,
    Error,
    ImportTicket,
    Manifest,
    OutOfPagesError,
    OwnershipTable,
    PageInfo,
    PageRef,
    PinnedImport,
    PoolConfig,
    PoolSnapshot,
    Receiver,
    Released,
    Recorder,
    Replayer,
    ReplayViolation,
    RequestInfo,
    HeldBlockTable,
    RowCache,
    ScrubError,
    StepVerdict,
    TraceError,
    TransferError,
    Violation,
    ViolationError,
    __version__,
    driver_available,
    mark_pages,
    page_checksum,
    prompt_digest,
)

__all__ = [
    "PADDING_SLOT",
    "VIOLATION_KINDS",
    "Accepted",
    "ConfigError",
    "DeviceError",
    "DeviceGuard",
    "Error",
    "ImportTicket",
    "Manifest",
    "OutOfPagesError",
    "OwnershipTable",
    "PageInfo",
    "PageRef",
    "PinnedImport",
    "PoolConfig",
    "PoolSnapshot",
    "Receiver",
    "Released",
    "Recorder",
    "Replayer",
    "ReplayViolation",
    "RequestInfo",
    "HeldBlockTable",
    "RowCache",
    "ScrubError",
    "StepVerdict",
    "TraceError",
    "TransferError",
    "Violation",
    "ViolationError",
    "__version__",
    "driver_available",
    "mark_pages",
    "page_checksum",
    "prompt_digest",
]

# Checked transfers over NIXL: only in a wheel built with the `nixl` feature (scripts/ci/python.sh
# builds it so where scripts/ci/nixl.sh set NIXL up); libnixl_capi.so is loaded when an agent is
# made (nixl_library_available() says whether it can be).
try:
    from ._kvguard import EnginePool, HostRegion, NixlAgent, NixlError, NixlLink, nixl_library_available
except ImportError:  # a wheel without the nixl feature
    pass
else:
    __all__ += ["EnginePool", "HostRegion", "NixlAgent", "NixlError", "NixlLink", "nixl_library_available"]
