"""wsync as a vLLM weight-transfer backend, named ``"wsync"``.

vLLM moves trainer weights into its workers through a pluggable engine pair (see vLLM's
``vllm/distributed/weight_transfer/``): a worker-side engine that vLLM builds from
``WeightTransferConfig(backend=...)`` and drives through the four phases (init, start, update,
finish), and a trainer-side engine built by ``WeightTransferTrainerFactory.trainer_init`` that
drives those phases through a client. This module gives both for wsync:

- :class:`WsyncTrainerEngine` publishes the trainer's weights through a wsync bridge
  (:func:`wsync.make_weight_bridge`) and sends ``update_info = {"manifest": <Manifest JSON>,
  "names": [...], "dtype_names": [...], "shapes": [...]}`` through its client: a
  :class:`wsync.http_client.VLLMHTTPClient` (to a vLLM server, or to a wsync consumer that speaks
  the same routes), or any object with vLLM's client methods.
- :class:`WsyncWeightTransferEngine` imports each manifest through its own bridge, verifies the
  checksums before anything is loaded, calls ``load_weights`` with the tensors in manifest
  order, then acknowledges and releases the update.

Bytes travel through wsync's transports (shared memory, file-mmap, ...), never through the HTTP
body: only the manifest does.

Usage, trainer side (vLLM >= 0.26 has trainer engines)::

    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.base import ModuleSource
    import wsync.vllm  # registers "wsync"

    engine = WeightTransferTrainerFactory.trainer_init(
        "wsync", config, {"rank": 0, "transport": "shared-memory"},
        client=VLLMHTTPClient("http://127.0.0.1:8000"), source=ModuleSource(model))
    engine.send_weights()          # start -> update -> finish, one version per call

Worker side: the worker processes must import this module (or call :func:`register`) before vLLM
builds the engine, e.g. through vLLM's ``vllm.general_plugins`` entry point pointing at
``wsync.vllm:register``; then serve with ``--weight-transfer-config '{"backend": "wsync"}'``.

vLLM's engine interface changed across releases; the worker engine accepts each form it has
had: ``__init__(config, parallel_config)`` (up to about v0.24) and ``__init__(config,
vllm_config, device, model)`` (v0.25+); ``receive_weights(update_info, load_weights)`` and
``receive_weights(update_info)`` (loading into ``self.model``); ``start_weight_update()`` with or
without ``is_checkpoint_format``. Without a start, each ``receive_weights`` is a whole update.
"""

import contextlib
import dataclasses
import importlib.util
import json
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from wsync._errors import (BlockedError, IllegalTransitionError, InstallFailedError,
                           InvalidArgumentError, VersionNotMonotonicError, WeightSyncError,
                           error_for)

__all__ = [
    "BACKEND",
    "WsyncInitInfo",
    "WsyncUpdateInfo",
    "WsyncTrainerInitInfo",
    "WsyncWeightTransferEngine",
    "WsyncTrainerEngine",
    "register",
]

BACKEND = "wsync"

# wsync's wire dtype names -> torch attribute names, as vLLM's dtype_names spell them.
_TORCH_NAMES = {
    "f64": "float64", "f32": "float32", "f16": "float16", "bf16": "bfloat16",
    "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "i64": "int64", "i32": "int32",
    "i16": "int16", "i8": "int8", "u8": "uint8", "bool": "bool",
}
_WIRE_NAMES = {torch_name: wire for wire, torch_name in _TORCH_NAMES.items()}

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
    if not isinstance(name, str):
        name = str(name)
    if name.startswith("torch."):
        name = name[len("torch."):]
    if name in _TORCH_NAMES:
        return name
    return _WIRE_NAMES.get(name)


def _options_text(options: Optional[Dict[str, Any]], where: str) -> Dict[str, str]:
    """Transport options as text, as ``--transport-option`` gives them: numbers and booleans
    become their JSON text."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise InvalidArgumentError(f"{where}: must be a dict of option names to values, "
                                   f"e.g. {{\"dir\": \"/shared/w\"}}")
    out = {}
    for k, v in options.items():
        if isinstance(v, str):
            out[str(k)] = v
        elif isinstance(v, (bool, int, float)):
            out[str(k)] = json.dumps(v)
        else:
            raise InvalidArgumentError(f"{where}.{k}: must be a string or a number")
    return out


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
        copy_to_cpu: copy device tensors to host memory before publishing (a build without
            CUDA transports refuses device tensors); the copies live until the publish ends.
    """

    rank: int
    transport: str = "shared-memory"
    transport_options: Optional[Dict[str, Any]] = None
    model_id: str = "model"
    first_version: int = 1
    metadata: Optional[Dict[str, Any]] = None
    copy_to_cpu: bool = False


@dataclass
class _Imported:
    """One manifest imported during the current update."""

    manifest: Any
    tensors: Dict[str, Any]
    loaded: set = field(default_factory=set)


class WsyncWeightTransferEngine:
    """vLLM worker-side engine: receives wsync manifests and loads their tensors.

    vLLM builds it with ``(config, vllm_config, device, model)`` (older releases:
    ``(config, parallel_config)``) and calls, in order: ``init_transfer_engine(init_info)`` once,
    then per update ``start_weight_update()``, ``update_weights(update_info)`` (or
    ``receive_weights(...)``) once or more, and ``finish_weight_update()``; ``shutdown()`` at the
    end. See :class:`WsyncInitInfo` and :class:`WsyncUpdateInfo` for the infos.

    Each manifest is imported through this worker's bridge and its checksums are verified before
    any of its tensors is loaded; the tensors are the publisher's memory (zero-copy, read-only),
    so ``load_weights`` must copy them, as vLLM's loaders do. At finish every manifest of the
    update is acknowledged and released, and ``weight_version`` becomes the update's version. A
    version not above the last one is refused.

    Loading is in place, as with vLLM's own engines: when a chunk fails after earlier chunks of
    the same update were loaded, those stay loaded; the update fails at finish (its manifests
    rejected) and the trainer sends a new version.
    """

    init_info_cls = WsyncInitInfo
    update_info_cls = WsyncUpdateInfo
    supports_draft_weight_update = True

    def __init__(self, config: Any, vllm_config: Any, device: Any = None,
                 model: Any = None) -> None:
        """Keeps vLLM's configs, the worker's device and the model to load into.

        Args:
            config: vLLM's ``WeightTransferConfig`` (``backend == "wsync"``).
            vllm_config: vLLM's ``VllmConfig``, or its ``ParallelConfig`` (older vLLM).
            device: the device the model lives on.
            model: the model that receives the weights (needed when ``receive_weights`` gets no
                ``load_weights``).
        """
        self.config = config
        self.vllm_config = vllm_config
        if hasattr(vllm_config, "parallel_config"):
            self.parallel_config = vllm_config.parallel_config
            self.model_config = getattr(vllm_config, "model_config", None)
        else:
            self.parallel_config = vllm_config
            self.model_config = None
        self.device = device
        self.model = model
        # vLLM's layerwise reload runs only for a model vLLM itself built and configured.
        self._inside_vllm = type(vllm_config).__module__.split(".")[0] == "vllm"
        self._default_model = model
        self._default_model_config = self.model_config
        self.bridge: Any = None
        self.transport: Optional[str] = None
        self.transport_options: Dict[str, str] = {}
        self.weight_version = 0  # the last version finished
        self._started = False
        self._checkpoint_format = True
        self._layerwise = False
        self._pending: List[_Imported] = []
        self._failure: Optional[str] = None

    # -- vLLM's parsing hooks -------------------------------------------------------------------

    def parse_init_info(self, init_dict: Any) -> WsyncInitInfo:
        """``init_info`` dict -> :class:`WsyncInitInfo`; InvalidArgumentError naming a wrong
        field, BlockedError for NCCL rendezvous fields."""
        return _from_dict(self.init_info_cls, init_dict, "init_info")

    def parse_update_info(self, update_dict: Any) -> WsyncUpdateInfo:
        """``update_info`` dict -> :class:`WsyncUpdateInfo`; InvalidArgumentError naming a
        wrong field."""
        return _from_dict(self.update_info_cls, update_dict, "update_info")

    # -- the phases -----------------------------------------------------------------------------

    def init_transfer_engine(self, init_info: Any) -> None:
        """Opens this worker's bridge on the transport ``init_info`` names.

        A second init must name the same transport and options (InvalidArgumentError
        otherwise); it changes nothing.
        """
        info = self.parse_init_info(init_info)
        if not isinstance(info.transport, str) or not info.transport:
            raise InvalidArgumentError("init_info.transport: must be a non-empty string")
        options = _options_text(info.transport_options, "init_info.transport_options")
        if self.bridge is not None:
            if info.transport != self.transport:
                raise InvalidArgumentError(
                    f"init_info.transport: \"{info.transport}\" differs from \"{self.transport}\","
                    " which this worker was initialised with")
            if options != self.transport_options:
                raise InvalidArgumentError("init_info.transport_options: differ from those this "
                                           "worker was initialised with")
            return
        rank = int(getattr(self.parallel_config, "rank", 0) or 0)
        self.bridge = _make_bridge(info.transport, source_worker=f"vllm-worker-{rank}",
                                   source_rank=rank, options=options)
        self.transport = info.transport
        self.transport_options = options

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        """Starts an update: the following chunks belong to it until ``finish_weight_update``.

        With checkpoint-format weights inside vLLM this also begins vLLM's layerwise reload
        (when this vLLM has it), as vLLM's own checkpoint-format engines do.

        Args:
            is_checkpoint_format: vLLM between #39212 and #44353 passes it: ``False`` copies
                tensors straight into parameters of the same name instead of ``load_weights``.
        """
        self._begin("start_weight_update", is_checkpoint_format)
        if is_checkpoint_format and self.model is not None and self._inside_vllm:
            self._layerwise = _layerwise_reload("initialize", self.model, self.model_config,
                                                self.device)

    def update_weights(self, update_info: Any) -> None:
        """vLLM's entry for one chunk: parses ``update_info`` (a dict, or a list of them) and
        receives it into ``self.model``."""
        infos = update_info if isinstance(update_info, list) else [update_info]
        if not infos:
            raise InvalidArgumentError("update_info: an empty list")
        for info in infos:
            self.receive_weights(self.parse_update_info(info))
        _synchronize(self.device)

    def receive_weights(self, update_info: Any,
                        load_weights: Optional[Callable[[List[Tuple[str, Any]]], Any]] = None
                        ) -> None:
        """Imports the chunk's manifests, verifies them and loads the chunk's tensors.

        Args:
            update_info: a :class:`WsyncUpdateInfo` (or its dict).
            load_weights: called once with the chunk's ``(name, tensor)`` pairs in manifest
                order; vLLM passes the model's loader (older releases). ``None``: the model's
                own ``load_weights``, or, for kernel-format updates or models without one, a
                copy into the parameters and buffers of the same names.

        Outside a started update the call is a whole update: it is finished (acknowledged,
        released, ``weight_version`` set) before returning. Any failure rejects and releases the
        update's manifests; the update then fails at finish.
        """
        info = self.parse_update_info(update_info)
        whole = not self._started
        if whole:
            self._begin("receive_weights", info.is_checkpoint_format)
        elif self._failure is not None:
            raise IllegalTransitionError(
                f"receive_weights: this update already failed ({self._failure}); finish it and "
                "start another")
        try:
            chunk = self._import_chunk(info)
            loader = load_weights or self._default_loader()
            loader(chunk)
            for entry in self._pending:
                entry.loaded.update(name for name, _ in chunk if name in entry.tensors)
        except BaseException as e:
            self._fail(str(e) or type(e).__name__)
            if whole:
                self._started = False
                self._failure = None
            raise
        if whole:
            self.finish_weight_update()

    def finish_weight_update(self) -> None:
        """Finishes the update: every manifest received since the start must have had all its
        tensors loaded; each is acknowledged and released, and ``weight_version`` becomes the
        update's version. Closes the phase whatever happens.

        Raises:
            IllegalTransitionError: no update was started, or none of its chunks came.
            InstallFailedError: a chunk failed earlier, or some tensors were never loaded (the
                manifests are rejected).
        """
        if not self._started:
            raise IllegalTransitionError("finish_weight_update: out of order: no weight update "
                                         "is started (call start_weight_update first)")
        self._started = False
        failure, self._failure = self._failure, None
        try:
            if failure is not None:
                raise InstallFailedError(f"finish_weight_update: the update failed: {failure}")
            if not self._pending:
                raise IllegalTransitionError("finish_weight_update: no weights received since "
                                             "start_weight_update")
            for entry in self._pending:
                missing = [_tensor_field(t, "name") for t in entry.manifest.tensors
                           if _tensor_field(t, "name") not in entry.loaded]
                if missing:
                    shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
                    reason = (f"finish_weight_update: {len(missing)} tensor(s) of update "
                              f"{entry.manifest.update_id} were never loaded: {shown}")
                    self._fail(reason)
                    raise InstallFailedError(reason)
        finally:
            if self._layerwise:
                self._layerwise = False
                _layerwise_reload("finalize", self.model, self.model_config, self.device)
        version = self._pending[0].manifest.weight_version
        try:
            for entry in self._pending:
                self.bridge.acknowledge(entry.manifest.update_id)
        finally:
            self._release_pending()
        self.weight_version = version

    def shutdown(self) -> None:
        """Rejects and releases an unfinished update and drops the bridge."""
        if self._pending:
            self._fail("shutdown: the worker stopped during the update")
        self._started = False
        self.bridge = None

    # -- vLLM's draft-model hooks ---------------------------------------------------------------

    def set_weight_update_target(self, model: Any, model_config: Any) -> None:
        """Points the following update at another model (vLLM: the speculative draft)."""
        self.model = model
        self.model_config = model_config

    def reset_weight_update_target(self) -> None:
        """Points updates back at the model the engine was built with."""
        self.model = self._default_model
        self.model_config = self._default_model_config

    # -- vLLM's older trainer entry -------------------------------------------------------------

    @staticmethod
    def trainer_send_weights(iterator: Iterable[Tuple[str, Any]], trainer_args: Any) -> Any:
        """vLLM's static trainer entry (before trainer engines): publishes and sends one chunk.

        Args:
            iterator: ``(name, tensor)`` pairs.
            trainer_args: a dict with ``bridge`` (a wsync bridge the caller keeps; it holds the
                published bytes), ``weight_version`` (int), and ``client`` (an object with
                ``update_weights``) or ``url`` (plus optional ``token``) of a server.

        Returns:
            The published Manifest. The caller starts and finishes the update around this
            call where its vLLM has those phases, then releases the manifest's ``update_id``
            on its bridge once the next version is active.
        """
        args = dict(trainer_args) if isinstance(trainer_args, dict) else vars(trainer_args)
        for key in ("bridge", "weight_version"):
            if args.get(key) is None:
                raise InvalidArgumentError(f"trainer_args.{key}: missing")
        client = args.get("client")
        if client is None:
            if not args.get("url"):
                raise InvalidArgumentError("trainer_args.client: missing (or give url)")
            from wsync.http_client import VLLMHTTPClient

            client = VLLMHTTPClient(args["url"], token=args.get("token"))
        manifest = args["bridge"].publish(_detached(iterator), int(args["weight_version"]))
        try:
            client.update_weights(_update_info_of(manifest))
        except BaseException:
            args["bridge"].release(manifest.update_id)
            raise
        return manifest

    # -- internals ------------------------------------------------------------------------------

    def _begin(self, call: str, is_checkpoint_format: bool) -> None:
        if self.bridge is None:
            raise IllegalTransitionError(f"{call}: out of order: the weight transfer is not "
                                         "initialised (call init_transfer_engine first)")
        if self._started:
            raise IllegalTransitionError(f"{call}: out of order: a weight update is already "
                                         "started; finish it first")
        self._started = True
        self._checkpoint_format = bool(is_checkpoint_format)
        self._failure = None
        self._pending = []

    def _import_chunk(self, info: WsyncUpdateInfo) -> List[Tuple[str, Any]]:
        """Checks the chunk against its manifests, then imports and verifies the new ones; the
        chunk's (name, tensor) pairs in manifest order. Nothing is imported for a chunk whose
        description is wrong."""
        given = info.manifest
        listed = isinstance(given, (list, tuple))
        if given is None:
            manifests = []
        elif listed:
            if not given:
                raise InvalidArgumentError("update_info.manifest: an empty list")
            manifests = [_parse_manifest(m, f"update_info.manifest[{i}]")
                         for i, m in enumerate(given)]
        else:
            manifests = [_parse_manifest(given, "update_info.manifest")]
        if not manifests and not self._pending:
            raise InvalidArgumentError("update_info.manifest: missing, and no manifest of this "
                                       "update came before")
        if not manifests and info.names is None:
            raise InvalidArgumentError("update_info.names: missing: a chunk without a manifest "
                                       "must name its tensors")
        known = [e.manifest for e in self._pending]
        for i, m in enumerate(manifests):
            self._check_new(m, "update_info.manifest" + (f"[{i}]" if listed else ""), known)
            known.append(m)
        names = self._chunk_names(info, known, manifests)
        fresh = []
        for m in manifests:
            # Checksums are recomputed on import; a mismatch is rejected and released there.
            entry = _Imported(m, self.bridge.import_update(m, verify=True))
            self._pending.append(entry)  # from here on, a failure rejects and releases it
            fresh.append(entry)
        chunk = []
        for e in self._pending:  # manifest order, whatever order the names came in
            for t in e.manifest.tensors:
                name = _tensor_field(t, "name")
                if name in names:
                    names.discard(name)
                    chunk.append((name, e.tensors[name]))
        return chunk

    def _check_new(self, m: Any, where: str, known: Sequence[Any]) -> None:
        if m.transport != self.transport:
            raise InvalidArgumentError(f"{where}.transport: \"{m.transport}\" differs from the "
                                       f"initialised transport \"{self.transport}\"")
        if m.weight_version <= self.weight_version:
            raise VersionNotMonotonicError(
                f"{where}.weight_version: weight_version must increase monotonically: "
                f"{m.weight_version} is not above the active {self.weight_version}")
        for first in known:
            if m.update_id == first.update_id:
                raise InvalidArgumentError(f"{where}.update_id: sent twice ({m.update_id})")
            if (m.model_id, m.weight_version) != (first.model_id, first.weight_version):
                raise InvalidArgumentError(
                    f"{where}.weight_version: {m.model_id}@{m.weight_version} is not the update "
                    f"{first.model_id}@{first.weight_version} the shards before it belong to")

    @staticmethod
    def _chunk_names(info: WsyncUpdateInfo, known: Sequence[Any],
                     fresh: Sequence[Any]) -> set:
        """The names the chunk loads, after checking names / dtype_names / shapes against the
        manifests (``known``: every manifest of the update so far, ``fresh``: this chunk's)."""
        count = None
        for key in ("names", "dtype_names", "shapes"):
            value = getattr(info, key)
            if value is None:
                continue
            if not isinstance(value, (list, tuple)):
                raise InvalidArgumentError(f"update_info.{key}: must be a list")
            if count is not None and len(value) != count:
                raise InvalidArgumentError(f"update_info.{key}: has {len(value)} entries, names "
                                           f"has {count}")
            count = len(value)
        if info.names is None:
            if info.dtype_names is not None or info.shapes is not None:
                raise InvalidArgumentError("update_info.names: missing (dtype_names / shapes "
                                           "need it)")
            return {_tensor_field(t, "name") for m in fresh for t in m.tensors}
        described = {}
        for m in known:
            for t in m.tensors:
                described.setdefault(_tensor_field(t, "name"), t)
        for i, name in enumerate(info.names):
            at = f"[{i}]"
            t = described.get(name) if isinstance(name, str) else None
            if t is None:
                raise InvalidArgumentError(f"update_info.names{at}: {name!r} is not in the "
                                           "manifest")
            if info.dtype_names is not None:
                wire = _wire_dtype(info.dtype_names[i])
                if wire is None:
                    raise InvalidArgumentError(f"update_info.dtype_names{at}: "
                                               f"{info.dtype_names[i]!r} is not a dtype")
                if wire != _tensor_field(t, "dtype"):
                    raise InvalidArgumentError(
                        f"update_info.dtype_names{at}: {info.dtype_names[i]} differs from the "
                        f"manifest's {_tensor_field(t, 'dtype')} for \"{name}\"")
            if info.shapes is not None:
                shape = info.shapes[i]
                if (not isinstance(shape, (list, tuple))
                        or list(shape) != list(_tensor_field(t, "shape"))):
                    raise InvalidArgumentError(f"update_info.shapes{at}: differs from the "
                                               f"manifest's shape for \"{name}\"")
        return set(info.names)

    def _default_loader(self) -> Callable[[List[Tuple[str, Any]]], Any]:
        model = self.model
        if model is None:
            raise InvalidArgumentError("receive_weights: load_weights: missing, and the engine "
                                       "has no model to load into")
        if self._checkpoint_format and callable(getattr(model, "load_weights", None)):
            return model.load_weights
        return lambda weights: _copy_by_name(model, weights)

    def _fail(self, reason: str) -> None:
        """Rejects and releases every manifest of the current update."""
        self._failure = reason
        for entry in self._pending:
            try:
                self.bridge.reject(entry.manifest.update_id, reason)
            except WeightSyncError:
                pass  # already rejected, or never fully imported: release still applies
        self._release_pending()

    def _release_pending(self) -> None:
        pending, self._pending = self._pending, []
        for entry in pending:
            entry.tensors.clear()  # drop the views before the bytes go
            try:
                self.bridge.release(entry.manifest.update_id)
            except WeightSyncError as e:
                warnings.warn(f"wsync: release of {entry.manifest.update_id} failed: {e}")


def _copy_by_name(model: Any, weights: Iterable[Tuple[str, Any]]) -> None:
    """Kernel-format load: copies each tensor into the parameter or buffer of its name."""
    import torch

    targets = dict(model.named_parameters())
    targets.update(model.named_buffers())
    with torch.no_grad():
        for name, tensor in weights:
            target = targets.get(name)
            if target is None:
                raise InvalidArgumentError(f"load_weights: {name!r} is not a parameter or buffer "
                                           "of the model")
            if tuple(target.shape) != tuple(tensor.shape):
                raise InvalidArgumentError(f"load_weights: {name!r}: shape {list(tensor.shape)} "
                                           f"differs from the model's {list(target.shape)}")
            target.copy_(tensor)


def _layerwise_reload(step: str, model: Any, model_config: Any, device: Any) -> bool:
    """vLLM's layerwise reload around a checkpoint-format update, where this vLLM has it.
    Returns whether it ran."""
    try:
        from vllm.model_executor.model_loader import reload
    except ImportError:
        return False
    import torch

    with torch.device(device) if device is not None else contextlib.nullcontext():
        if step == "initialize":
            reload.initialize_layerwise_reload(model)
        else:
            reload.finalize_layerwise_reload(model, model_config)
    return True


def _synchronize(device: Any) -> None:
    """Waits for device copies, so the next step reads the new weights."""
    if device is None or getattr(device, "type", str(device).split(":")[0]) != "cuda":
        return
    import torch

    torch.cuda.synchronize(device)


def _detached(source: Iterable[Tuple[str, Any]]) -> Iterable[Tuple[str, Any]]:
    for name, tensor in source:
        yield name, tensor.detach() if hasattr(tensor, "detach") else tensor


def _update_info_of(manifest: Any) -> Dict[str, Any]:
    """What the trainer sends: the manifest's JSON text and vLLM's chunk description."""
    tensors = manifest.tensors
    return {
        "manifest": manifest.to_json(),
        "names": [_tensor_field(t, "name") for t in tensors],
        "dtype_names": [_TORCH_NAMES.get(_tensor_field(t, "dtype"), _tensor_field(t, "dtype"))
                        for t in tensors],
        "shapes": [list(_tensor_field(t, "shape")) for t in tensors],
    }


class WsyncTrainerEngine:
    """vLLM trainer-side engine: publishes the source's weights through wsync, one version per
    :meth:`send_weights`, and drives the worker's phases through the client.

    Built by :meth:`trainer_init` (vLLM's ``WeightTransferTrainerFactory.trainer_init("wsync",
    ...)``). Rank 0 publishes and calls the client; every other rank only iterates the source,
    keeping collectives such as FSDP's all-gather in step.

    The published bytes stay held until the next version is active on the workers (the active
    one may be read from the publisher's memory, as a wsync consumer does); :meth:`shutdown`
    releases what is left.
    """

    init_info_cls = WsyncTrainerInitInfo
    config_cls: Any = None  # vLLM's WeightTransferConfig; any object is kept as it is

    def __init__(self, config: Any, *, client: Any, source: Any, is_sender: bool = True,
                 init_info: Optional[WsyncTrainerInitInfo] = None) -> None:
        """Keeps the config, client and source; :meth:`trainer_init` is the way to build one.

        Args:
            config: vLLM's weight-transfer config (kept, not read).
            client: vLLM's ``VLLMWeightSyncClient`` (e.g. :class:`VLLMHTTPClient`): needs
                ``update_weights``; ``init_weight_transfer_engine``, ``start_weight_update`` and
                ``finish_weight_update`` are called where it has them.
            source: the weights: an iterable of ``(name, tensor)`` iterated afresh each round
                (vLLM's ``WeightSource``), or an ``nn.Module``.
            is_sender: whether this rank publishes and calls the client.
            init_info: the trainer init info.
        """
        if client is None or not callable(getattr(client, "update_weights", None)):
            raise InvalidArgumentError("client: must have update_weights(update_info)")
        self.config = config
        self.client = client
        self.source = source
        self.is_sender = is_sender
        self.init_info = init_info or WsyncTrainerInitInfo(rank=0 if is_sender else 1)
        self.bridge: Any = None
        self.weight_version = 0  # the last version the workers finished
        self._held: List[Any] = []  # manifests published and not released yet

    @classmethod
    def trainer_init(cls, config: Any, init_info: Any, *, client: Any,
                     source: Any) -> "WsyncTrainerEngine":
        """Builds the engine; on rank 0 opens the bridge and initialises the workers.

        Args:
            config: vLLM's weight-transfer config.
            init_info: a :class:`WsyncTrainerInitInfo` or its dict (``rank`` required).
            client: see :meth:`__init__`.
            source: see :meth:`__init__`.

        Returns:
            The engine; :meth:`send_weights` may be called next.
        """
        info = _from_dict(cls.init_info_cls, init_info, "init_info")
        if not isinstance(info.rank, int) or info.rank < 0:
            raise InvalidArgumentError(f"init_info.rank: must be an int >= 0, not {info.rank!r}")
        if not isinstance(info.first_version, int) or info.first_version < 1:
            raise InvalidArgumentError("init_info.first_version: must be an int >= 1")
        if source is None:
            raise InvalidArgumentError("source: missing")
        options = _options_text(info.transport_options, "init_info.transport_options")
        engine = cls(config, client=client, source=source, is_sender=info.rank == 0,
                     init_info=info)
        engine.weight_version = info.first_version - 1
        if engine.is_sender:
            engine.bridge = _make_bridge(info.transport, source_worker="trainer",
                                         source_rank=info.rank, model_id=info.model_id,
                                         options=options)
            worker_info: Dict[str, Any] = {"transport": info.transport}
            if options:
                worker_info["transport_options"] = options
            init = getattr(client, "init_weight_transfer_engine", None)
            if callable(init):
                init(worker_info)
        return engine

    def send_weights(self, weight_version: Optional[int] = None) -> Any:
        """One round: publish the source as the next version, then start, update and finish on
        the workers.

        Args:
            weight_version: the version to publish; default one above the last.

        Returns:
            The published Manifest on rank 0, ``None`` on the other ranks. On failure the new
            version is released and the previous one stays held (and active on the workers);
            a worker whose update call failed may still be mid-update, as with vLLM's own
            engines (a wsync consumer then refuses the next start with 409 until an update is
            finished).
        """
        version = self.weight_version + 1 if weight_version is None else int(weight_version)
        if version <= self.weight_version:
            raise VersionNotMonotonicError(
                f"send_weights: weight_version must increase monotonically: {version} is not "
                f"above {self.weight_version}")
        if not self.is_sender:
            for _ in _pairs(self.source):
                pass
            self.weight_version = version
            return None
        if self.bridge is None:
            raise IllegalTransitionError("send_weights: the engine is shut down")
        pairs = _detached(_pairs(self.source))
        if self.init_info.copy_to_cpu:
            pairs = ((name, t.cpu()) for name, t in pairs)
        manifest = self.bridge.publish(pairs, version, metadata=self.init_info.metadata)
        try:
            start = getattr(self.client, "start_weight_update", None)
            if callable(start):
                start()
            self.client.update_weights(_update_info_of(manifest))
            finish = getattr(self.client, "finish_weight_update", None)
            if callable(finish):
                finish()
        except BaseException:
            self._release(manifest)
            raise
        previous, self._held = self._held, [manifest]
        for old in previous:
            self.bridge.release(old.update_id)
        self.weight_version = version
        return manifest

    def shutdown(self) -> None:
        """Releases every held version and drops the bridge."""
        held, self._held = self._held, []
        for manifest in held:
            self._release(manifest)
        self.bridge = None

    def _release(self, manifest: Any) -> None:
        # Never hides the error being raised, nor stops a shutdown: a failed release is warned.
        try:
            self.bridge.release(manifest.update_id)
        except WeightSyncError as e:
            warnings.warn(f"wsync: release of {manifest.update_id} failed: {e}")


def _pairs(source: Any) -> Iterable[Tuple[str, Any]]:
    """A fresh pass over the source: an nn.Module's named parameters, or the source itself."""
    named = getattr(source, "named_parameters", None)
    if callable(named) and not hasattr(source, "metadata"):
        return named()
    return iter(source)


def _registry_has(factory: Any, name: str) -> bool:
    return name in getattr(factory, "_registry", {})


def _with_base(ours: type, base: Optional[type]) -> type:
    """Our class, made a subclass of vLLM's base where that works (isinstance checks pass);
    our methods come first."""
    if base is None:
        return ours
    try:
        import types

        return types.new_class(ours.__name__, (ours, base), {},
                               lambda ns: ns.update({"__module__": __name__,
                                                     "__doc__": ours.__doc__}))
    except TypeError:
        return ours


def register() -> Dict[str, type]:
    """Registers the ``"wsync"`` backend with vLLM's engine factories (worker side, and
    trainer side where this vLLM has trainer engines). Safe to call more than once.

    Returns:
        The registered classes under ``"worker"`` and ``"trainer"``.

    Raises:
        ImportError: vLLM, or its weight-transfer factory, is not importable.
    """
    from vllm.distributed.weight_transfer import factory

    try:
        from vllm.distributed.weight_transfer import base
    except ImportError:  # pragma: no cover - every vLLM with a factory has a base
        base = None
    out: Dict[str, type] = {}
    worker = _with_base(WsyncWeightTransferEngine, getattr(base, "WeightTransferEngine", None))
    if not _registry_has(factory.WeightTransferEngineFactory, BACKEND):
        factory.WeightTransferEngineFactory.register_engine(BACKEND, worker)
    out["worker"] = worker
    trainer_factory = getattr(factory, "WeightTransferTrainerFactory", None)
    if trainer_factory is not None:
        trainer = _with_base(WsyncTrainerEngine,
                             getattr(base, "TrainerWeightTransferEngine", None))
        if not _registry_has(trainer_factory, BACKEND):
            trainer_factory.register_engine(BACKEND, trainer)
        out["trainer"] = trainer
    return out


if importlib.util.find_spec("vllm") is not None:
    try:
        register()
    except Exception as _e:  # an old vLLM without weight transfer: usable, not registered
        warnings.warn(f"wsync.vllm: not registered with vLLM: {_e}")
