# Type stubs for the public API of `wsync` (what wsync/__init__.py exports). The implementation is
# in wsync/_bridge.py, _cluster.py and _errors.py over the _wsync extension. python/tests/
# test_stubs.py fails when a name or a parameter here differs from the code.

import concurrent.futures
from typing import (Any, ContextManager, Dict, Iterable, List, Mapping, Optional, Sequence,
                    Tuple, Union)

import torch

from wsync.http_client import VLLMHTTPClient as VLLMHTTPClient

__version__: str

# What publish() takes: a module (its state_dict()), a state dict, or (name, tensor) pairs.
_Source = Union[torch.nn.Module, Mapping[str, torch.Tensor], Iterable[Tuple[str, torch.Tensor]]]

# --- errors ----------------------------------------------------------------------------------

class WeightSyncError(Exception):
    """Base of every wsync error: ``code`` is the C++ error code's name, ``message`` the text."""

    code: str
    message: str
    def __init__(self, message: str = ..., code: Optional[str] = ...) -> None: ...

class InvalidManifestError(WeightSyncError):
    """A manifest field is malformed or inconsistent (code ``invalid_manifest``)."""

class VersionNotMonotonicError(WeightSyncError):
    """A weight_version did not increase (code ``version_not_monotonic``)."""

class IllegalTransitionError(WeightSyncError):
    """A lifecycle call came in the wrong state (code ``illegal_transition``; HTTP 409)."""

class ChecksumMismatchError(WeightSyncError):
    """Tensor bytes differ from the manifest's checksum (code ``checksum_mismatch``)."""

class UnknownUpdateError(WeightSyncError):
    """No update with this id is known here (code ``unknown_update``)."""

class UnknownTransportError(WeightSyncError):
    """No transport of this name in this build (code ``unknown_transport``)."""

class InvalidArgumentError(WeightSyncError):
    """A caller-supplied value is missing, malformed or out of range (code ``invalid_argument``)."""

class BlockedError(WeightSyncError):
    """The transport or request cannot run here (code ``blocked``)."""

class WeightSyncTimeoutError(WeightSyncError):
    """A bounded wait ran out (code ``timeout``)."""

class TransportIOError(WeightSyncError):
    """An operating-system or network call failed (code ``io_error``)."""

class InstallFailedError(WeightSyncError):
    """The rollout side refused the update; the previous version stays (code ``install_failed``)."""

class HTTPError(WeightSyncError):
    """A non-2xx HTTP answer; raised as a class that is also the error class of its code."""

    status: int
    body: str
    path: str
    def __init__(self, message: str = ..., code: Optional[str] = ..., status: int = ...,
                 body: str = ..., path: str = ...) -> None: ...

# --- manifests -------------------------------------------------------------------------------

class TensorInfo:
    """Where one tensor lies in an update (read-only)."""

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> str:
        """Wire dtype name: ``f32``, ``bf16``, ``i64``, ``bool``, ..."""
    @property
    def shape(self) -> List[int]: ...
    @property
    def strides(self) -> List[int]:
        """In elements; empty means contiguous row-major."""
    @property
    def nbytes(self) -> int: ...
    @property
    def device(self) -> str: ...
    @property
    def segment(self) -> int: ...
    @property
    def offset(self) -> int:
        """Byte offset inside the segment (256-byte aligned)."""
    @property
    def checksum(self) -> int:
        """XXH3-64 of the tensor's bytes."""

class Manifest:
    """One publisher rank's shard of one version: immutable; JSON and pickle round-trip."""

    @property
    def update_id(self) -> str: ...
    @property
    def model_id(self) -> str: ...
    @property
    def weight_version(self) -> int: ...
    @property
    def source_worker(self) -> str: ...
    @property
    def source_rank(self) -> int: ...
    @property
    def transport(self) -> str: ...
    @property
    def transport_handle(self) -> str:
        """Opaque; written and read only by the transport."""
    @property
    def tensors(self) -> List[TensorInfo]: ...
    @property
    def metadata(self) -> Dict[str, str]: ...
    @property
    def total_bytes(self) -> int: ...
    @property
    def segment_bytes(self) -> List[int]: ...
    def to_json(self) -> str:
        """The manifest as compact JSON text (every field)."""
    @staticmethod
    def from_json(text: str) -> Manifest:
        """Parses and validates JSON made by :meth:`to_json` (InvalidManifestError otherwise)."""
    def validate(self) -> None:
        """Raises InvalidManifestError naming the first bad field."""
    def __eq__(self, other: object) -> bool: ...

# --- bridges ---------------------------------------------------------------------------------

class WeightBridge:
    """Publisher and/or consumer side of the weight-sync protocol over one transport."""

    transport: str
    source_worker: str
    source_rank: int
    model_id: str
    options: Dict[str, str]
    def __init__(self, transport: str = ..., source_worker: Optional[str] = ...,
                 source_rank: int = ..., model_id: str = ...,
                 options: Optional[Mapping[str, Any]] = ..., max_segment_bytes: int = ...,
                 copy_threads: int = ..., slot_wait_s: float = ...,
                 verify_threads: int = ..., checksum_chunk_bytes: int = ...) -> None: ...
    def publish(self, source: _Source, weight_version: int,
                metadata: Optional[Mapping[str, Any]] = ...) -> Manifest:
        """Publishes one complete version of CPU or CUDA tensors; the bytes stay until
        release()."""
    def import_update(self, manifest: Manifest, verify: bool = ...) -> Dict[str, torch.Tensor]:
        """Read-only tensors viewing the imported memory (no copy), in manifest order."""
    def acknowledge(self, update_id: str) -> None:
        """Says the update is installed in full (only after a successful import)."""
    def reject(self, update_id: str, reason: str) -> None:
        """Records that installing the update failed, and why."""
    def state(self, update_id: str) -> str:
        """The consumer-side lifecycle state: ``imported``, ``acknowledged``, ``rejected``, ..."""
    def release(self, update_id: str) -> None:
        """Drops this side's hold; memory still viewed goes with the last view."""
    def close(self) -> None:
        """Releases everything this bridge's publisher side still holds."""

class SharedMemoryTensorBridge(WeightBridge):
    """A bridge over POSIX shared memory: processes on one host, zero-copy import."""

    def __init__(self, *, source_worker: Optional[str] = ..., source_rank: int = ...,
                 model_id: str = ..., options: Optional[Mapping[str, Any]] = ...,
                 max_segment_bytes: int = ..., copy_threads: int = ..., slot_wait_s: float = ...,
                 verify_threads: int = ..., checksum_chunk_bytes: int = ...) -> None: ...

class LocalCloneTensorBridge(WeightBridge):
    """A bridge inside one process (imports are copies): the baseline for tests."""

    def __init__(self, *, source_worker: Optional[str] = ..., source_rank: int = ...,
                 model_id: str = ..., options: Optional[Mapping[str, Any]] = ...,
                 max_segment_bytes: int = ..., copy_threads: int = ..., slot_wait_s: float = ...,
                 verify_threads: int = ..., checksum_chunk_bytes: int = ...) -> None: ...

def make_weight_bridge(name: str, *, source_worker: Optional[str] = ..., source_rank: int = ...,
                       model_id: str = ..., options: Optional[Mapping[str, Any]] = ...,
                       max_segment_bytes: int = ..., copy_threads: int = ...,
                       slot_wait_s: float = ..., verify_threads: int = ...,
                       checksum_chunk_bytes: int = ...) -> WeightBridge:
    """A bridge over the transport ``name`` (aliases: ``local``, ``shm``); UnknownTransportError
    lists what this build has."""

class RolloutExecutor:
    """Import, verify, install, activate, acknowledge, release the previous update; on failure
    reject and keep the previous version."""

    weight_bridge: WeightBridge
    installer: Any
    last_report: Optional[Dict[str, Any]]
    def __init__(self, weight_bridge: WeightBridge, model: Optional[torch.nn.Module] = ...,
                 verify: bool = ...) -> None: ...
    def update_weights(self, manifest: Union[Manifest, Sequence[Manifest]]
                       ) -> Dict[str, torch.Tensor]:
        """Installs one version (one manifest per publisher rank); returns the active tensors."""
    @property
    def active_weight_version(self) -> Optional[int]:
        """The version readers see; None before the first successful update."""
    def release_weights(self) -> List[str]:
        """Releases the imports the active weights still hold; returns their ids. Without a
        model the executor then shows no weights (version None); a model keeps its copy."""
    def longest_wait(self) -> float:
        """The longest a generation step waited at the gate so far (seconds)."""
    def generating(self) -> ContextManager[float]:
        """One generation step: sees one whole version; yields the seconds it waited."""

# --- the cluster -----------------------------------------------------------------------------

class UpdateOutcome:
    """How one published version ended, as the coordinator saw it."""

    committed: bool
    reason: str
    ranks: List[Dict[str, Any]]
    table: Dict[str, Any]
    publish_s: float
    def __init__(self, raw: Dict[str, Any]) -> None: ...

class TrainerRank:
    """A trainer rank joined to a coordinator: publishes its shard of every version."""

    rank: int
    ranks: int
    model: Any
    model_id: str
    def __init__(self, coordinator: Optional[str] = ..., model: Optional[_Source] = ...,
                 rank: Optional[int] = ..., ranks: Optional[int] = ..., transport: str = ...,
                 token: Optional[str] = ..., model_id: str = ...,
                 options: Optional[Mapping[str, Any]] = ..., node: Optional[str] = ...,
                 outcome_timeout: float = ..., tls: Optional[Sequence[str]] = ...) -> None: ...
    def publish(self, model: Optional[_Source] = ..., weight_version: Optional[int] = ...,
                metadata: Optional[Mapping[str, Any]] = ...) -> UpdateOutcome:
        """Publishes this rank's shard and waits for the version's outcome."""
    def publish_async(self, model: Optional[_Source] = ..., weight_version: Optional[int] = ...,
                      metadata: Optional[Mapping[str, Any]] = ...
                      ) -> concurrent.futures.Future[UpdateOutcome]:
        """publish() in a background thread; leave the tensors alone until the future is done."""
    def held_versions(self) -> List[int]:
        """The versions whose memory this rank still holds, ascending."""
    def close(self) -> None:
        """Leaves the cluster."""
    def __enter__(self) -> TrainerRank: ...
    def __exit__(self, *exc: Any) -> None: ...

class RolloutRank:
    """A rollout rank joined to a coordinator that keeps a module on the newest committed
    version, in the background."""

    rank: int
    model: torch.nn.Module
    installer: Any
    def __init__(self, coordinator: Optional[str] = ..., model: Optional[torch.nn.Module] = ...,
                 rank: Optional[int] = ..., transport: str = ..., token: Optional[str] = ...,
                 model_id: str = ..., options: Optional[Mapping[str, Any]] = ...,
                 node: Optional[str] = ..., verify: bool = ..., join_timeout: float = ...,
                 tls: Optional[Sequence[str]] = ...) -> None: ...
    @property
    def active_weight_version(self) -> int:
        """The version readers see now; 0 before the first install."""
    def status(self) -> Dict[str, Any]:
        """Counts, the last update and its timings, the longest gate wait."""
    def wait_for_version(self, version: int, timeout: float = ...) -> int:
        """Blocks until the active version is at least ``version``; returns it."""
    def reset_longest_wait(self) -> None: ...
    def generating(self) -> ContextManager[float]:
        """One generation step: sees one whole version; yields the seconds it waited."""
    def close(self) -> None:
        """Leaves the cluster; the module keeps its version."""
    def __enter__(self) -> RolloutRank: ...
    def __exit__(self, *exc: Any) -> None: ...

def coordinator_status(coordinator: Optional[str] = ..., token: Optional[str] = ...,
                       tls: Optional[Sequence[str]] = ...) -> Dict[str, Any]:
    """The coordinator's status object (docs/cluster.md) as a dict."""

def wait_for_consumers(count: int, coordinator: Optional[str] = ..., token: Optional[str] = ...,
                       timeout: float = ..., tls: Optional[Sequence[str]] = ...
                       ) -> Dict[str, Any]:
    """Waits until ``count`` consumer ranks joined; returns the status object."""

def launch_rank() -> int:
    """RANK, else SLURM_PROCID, else 0."""

def launch_world_size() -> int:
    """WORLD_SIZE, else SLURM_NTASKS, else 1."""

def launch_local_rank() -> int:
    """LOCAL_RANK, else SLURM_LOCALID, else 0."""

# --- the build -------------------------------------------------------------------------------

def transports() -> List[str]:
    """Names of the transports this build has."""

def releases_pending() -> List[str]:
    """Update ids whose release waits for tensors of theirs still alive in this process."""
