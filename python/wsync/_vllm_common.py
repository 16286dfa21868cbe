"""What the wsync vLLM engines share: the info dataclasses vLLM parses, and the manifest and
dtype helpers both sides use (see wsync.vllm)."""

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Tuple

from wsync import _wsync
from wsync._errors import BlockedError, InvalidArgumentError, WeightSyncError, error_for

BACKEND = "wsync"

# init_info fields of vLLM's NCCL backend: a rendezvous wsync does not take part in.
_NCCL_FIELDS = ("master_address", "master_port", "nccl_unique_id_b64")


def _make_bridge(transport: str, **kwargs):
    """A wsync bridge for ``transport`` (one place, so tests can see what engines ask for)."""
    import wsync

    return wsync.make_weight_bridge(transport, **kwargs)


def _parse_manifest(value: Any, where: str):
    """A wsync Manifest from a Manifest, its JSON text or its JSON object."""
    import wsync

    if isinstance(value, wsync.Manifest):
        return value
    if isinstance(value, dict):
        value = json.dumps(value)
    if not isinstance(value, str):
        raise InvalidArgumentError(f"{where}: must be a wsync manifest (JSON text or object), "
                                   f"not {type(value).__name__}")
    try:
        return wsync.Manifest.from_json(value)
    except WeightSyncError as e:
        raise error_for(e.code, f"{where}: {e.message}") from e


def _tensor_field(info: Any, key: str) -> Any:
    # Manifest.tensors holds TensorInfo objects; accept their dict form too.
    return info[key] if isinstance(info, dict) else getattr(info, key)


def _wire_dtype(name: Any) -> Optional[str]:
    """wsync's name for a dtype spelled the wsync way, the torch way or as ``str(dtype)``."""
    name = str(name)
    return _wsync.dtype_parse(name[len("torch."):] if name.startswith("torch.") else name)


def _from_dict(cls, value: Any, where: str):
    """A dataclass from itself or a dict, naming unknown and missing fields."""
    if isinstance(value, cls):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)  # e.g. vLLM's own TrainerInitInfo(rank=0)
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"{where}: must be a dict or {cls.__name__}, "
                                   f"not {type(value).__name__}")
    for key in _NCCL_FIELDS:
        if key in value:
            raise BlockedError(f"{where}.{key}: blocked: NCCL rendezvous is not a wsync "
                               "transport; name a wsync transport (\"transport\": "
                               "\"shared-memory\") instead")
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(k for k in value if k not in known)
    if unknown:
        raise InvalidArgumentError(f"{where}.{unknown[0]}: not a field of {cls.__name__} "
                                   f"(fields: {', '.join(known)})")
    for name, f in known.items():
        required = (f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING)  # type: ignore[misc]
        if required and name not in value:
            raise InvalidArgumentError(f"{where}.{name}: missing")
    return cls(**value)


@dataclass
class WsyncInitInfo:
    """Worker-side ``init_info``: which wsync transport the manifests will name.

    Attributes:
        transport: a wsync transport name (``shared-memory``, ``file-mmap``, ...).
        transport_options: the transport's options, e.g. ``{"dir": "/shared/weights"}`` for
            ``file-mmap``.
    """

    transport: str = "shared-memory"
    transport_options: Optional[Dict[str, Any]] = None


@dataclass
class WsyncUpdateInfo:
    """Worker-side ``update_info``: one chunk of an update.

    Attributes:
        manifest: the update's wsync manifest (a Manifest, its JSON text or object), or a list
            of them (one per publisher shard, all of one version). A later chunk of the same
            update may leave it out and only name tensors of a manifest sent before.
        names: the chunk's tensors; absent: every tensor of the manifests in this chunk.
        dtype_names: their dtypes (``"bfloat16"``, ``"torch.bfloat16"`` or wsync's ``"bf16"``);
            checked against the manifest.
        shapes: their shapes; checked against the manifest.
        is_checkpoint_format: vLLM's flag for engines called without ``start_weight_update``:
            checkpoint-format tensors go through the model's ``load_weights``, others are
            copied into the parameters of the same name.
    """

    manifest: Any = None
    names: Optional[List[str]] = None
    dtype_names: Optional[List[str]] = None
    shapes: Optional[List[List[int]]] = None
    is_checkpoint_format: bool = True


@dataclass
class WsyncTrainerInitInfo:
    """Trainer-side init info.

    Attributes:
        rank: this trainer process's rank; rank 0 publishes and drives the client, the others
            only iterate the source in step (its iteration may be a collective).
        transport: the wsync transport to publish through.
        transport_options: its options (the worker receives the same ones at init).
        model_id: the manifests' model id (non-empty).
        first_version: the first ``weight_version`` sent; each ``send_weights`` adds one.
        metadata: put into every manifest (text values; others as JSON text).
        copy_to_cpu: copy device tensors to host memory before publishing, with torch (where
            wsync cannot copy from the device: a build without CUDA answers blocked); the
            copies live until the publish ends.
    """

    rank: int
    transport: str = "shared-memory"
    transport_options: Optional[Dict[str, Any]] = None
    model_id: str = "model"
    first_version: int = 1
    metadata: Optional[Dict[str, Any]] = None
    copy_to_cpu: bool = False


def _detached(source: Iterable[Tuple[str, Any]]) -> Iterable[Tuple[str, Any]]:
    for name, tensor in source:
        yield name, tensor.detach() if hasattr(tensor, "detach") else tensor


def _update_info_of(manifest: Any) -> Dict[str, Any]:
    """What the trainer sends: the manifest's JSON text and vLLM's chunk description."""
    tensors = manifest.tensors
    return {
        "manifest": manifest.to_json(),
        "names": [_tensor_field(t, "name") for t in tensors],
        "dtype_names": [_wsync.dtype_torch_name(_tensor_field(t, "dtype"))
                        for t in tensors],
        "shapes": [list(_tensor_field(t, "shape")) for t in tensors],
    }
