"""wsync: versioned weight updates from RL trainers to rollout workers.

Built for the interpreter CMake was pointed at (WSYNC_PYTHON, by default Debian's
/usr/bin/python3). Put ``build/default/python`` on PYTHONPATH. See docs/python.md.

- Bridges (one process, or processes sharing a manifest any way they like):
  :class:`SharedMemoryTensorBridge`, :func:`make_weight_bridge`, :class:`RolloutExecutor`.
- A cluster through a coordinator: :class:`TrainerRank`, :class:`RolloutRank`.
- vLLM's HTTP surface: :class:`VLLMHTTPClient`; vLLM engines: ``wsync.vllm``.
"""

from wsync._errors import (BlockedError, ChecksumMismatchError, HTTPError,
                           IllegalTransitionError, InstallFailedError, InvalidArgumentError,
                           InvalidManifestError, TransportIOError, UnknownTransportError,
                           UnknownUpdateError, VersionNotMonotonicError, WeightSyncError,
                           WeightSyncTimeoutError)
from wsync import _wsync
from wsync._bridge import (LocalCloneTensorBridge, Manifest, RolloutExecutor,
                           SharedMemoryTensorBridge, WeightBridge, make_weight_bridge)
from wsync._cluster import (RolloutRank, TrainerRank, UpdateOutcome, coordinator_status,
                            launch_local_rank, launch_rank, launch_world_size,
                            wait_for_consumers)
from wsync.http_client import VLLMHTTPClient

TensorInfo = _wsync.TensorInfo


def transports() -> list:
    """Names of the transports this build has."""
    return list(_wsync.transports())


def releases_pending() -> list:
    """Update ids whose release waits for tensors of theirs still alive in this process."""
    return list(_wsync.releases_pending())


__version__ = "0.1.0"

__all__ = [
    "BlockedError", "ChecksumMismatchError", "HTTPError", "IllegalTransitionError",
    "InstallFailedError", "InvalidArgumentError", "InvalidManifestError", "LocalCloneTensorBridge",
    "Manifest", "RolloutExecutor", "RolloutRank", "SharedMemoryTensorBridge", "TensorInfo",
    "TrainerRank", "TransportIOError", "UnknownTransportError", "UnknownUpdateError",
    "UpdateOutcome", "VLLMHTTPClient", "VersionNotMonotonicError", "WeightBridge",
    "WeightSyncError", "WeightSyncTimeoutError", "coordinator_status", "launch_local_rank",
    "launch_rank", "launch_world_size", "make_weight_bridge", "releases_pending", "transports",
    "wait_for_consumers",
]
