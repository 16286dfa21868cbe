"""vLLM's worker-side engine over wsync (see wsync.vllm)."""

import contextlib
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from wsync._errors import (IllegalTransitionError, InstallFailedError, InvalidArgumentError,
                           VersionNotMonotonicError, WeightSyncError)
from wsync._text import options_text
from wsync._vllm_common import (WsyncInitInfo, WsyncUpdateInfo, _detached, _from_dict,
                                _make_bridge, _parse_manifest, _tensor_field, _update_info_of,
                                _wire_dtype)


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
        options = options_text(info.transport_options, "init_info.transport_options")
        if self.bridge is not None:
            from wsync._bridge import canonical_transport  # torch only once it is used

            if canonical_transport(info.transport) != self.transport:
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
        # As manifests name it: an alias ("shm") would make every manifest differ.
        self.transport = self.bridge.transport
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
            try:
                self._layerwise = _layerwise_reload("initialize", self.model, self.model_config,
                                                    self.device)
            except BaseException:
                self._started = False  # not started: the next start must not be refused
                raise

    def update_weights(self, update_info: Any) -> None:
        """vLLM's entry for one chunk: parses ``update_info`` (a dict, or a list of them) and
        receives it into ``self.model``.

        Outside a started update the whole list is one update, finished once after its last
        entry: its manifests (the shards of one version) are installed together or not at all.
        """
        infos = update_info if isinstance(update_info, list) else [update_info]
        if not infos:
            raise InvalidArgumentError("update_info: an empty list")
        parsed = [self.parse_update_info(info) for info in infos]
        if self._started or len(parsed) == 1:
            for info in parsed:
                self.receive_weights(info)
        else:
            self._begin("update_weights", parsed[0].is_checkpoint_format)
            try:
                for info in parsed:
                    self.receive_weights(info)
            except BaseException:
                # receive_weights rejected and released what came: close the phase, as a
                # single whole update does.
                self._started = False
                self._failure = None
                raise
            self.finish_weight_update()
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
            loader = load_weights or self._default_loader(
                ", ".join(e.manifest.update_id for e in self._pending))
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
                failing = sys.exc_info()[1]  # the failure being raised, if any: it stays the one
                try:
                    _layerwise_reload("finalize", self.model, self.model_config, self.device)
                except BaseException as e:
                    # Not installed after all: rejected and released, or the publisher's
                    # memory stays taken with nobody left to answer for it.
                    if self._pending:
                        self._fail(f"finish_weight_update: vLLM's layerwise reload failed: {e}")
                    if failing is None:
                        raise
                    warnings.warn(f"wsync: vLLM's layerwise reload failed too, after the update "
                                  f"had failed: {e}")
        # The tensors are in the model by now, whatever the acknowledgements below do.
        self.weight_version = self._pending[0].manifest.weight_version
        acknowledged = 0
        try:
            for entry in self._pending:
                self.bridge.acknowledge(entry.manifest.update_id)
                acknowledged += 1
        except BaseException as e:
            # The shards not acknowledged are answered all the same, before their release.
            for entry in self._pending[acknowledged:]:
                try:
                    self.bridge.reject(entry.manifest.update_id,
                                       f"finish_weight_update: acknowledging failed: {e}")
                except WeightSyncError:
                    pass  # the failing shard's own state may not allow it
            raise
        finally:
            self._release_pending()

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
        # As the HTTP surface says it: the field, then the reason, then update and rank.
        context = f"update_id={m.update_id} rank={self.bridge.source_rank}"
        if m.transport != self.transport:
            raise InvalidArgumentError(f"{where}.transport: \"{m.transport}\" differs from the "
                                       f"initialised transport \"{self.transport}\" ({context})")
        if m.weight_version <= self.weight_version:
            raise VersionNotMonotonicError(
                f"{where}.weight_version: weight_version must increase monotonically: "
                f"{m.weight_version} is not above the active {self.weight_version} ({context})")
        for first in known:
            if m.update_id == first.update_id:
                raise InvalidArgumentError(f"{where}.update_id: sent twice ({context})")
            if (m.model_id, m.weight_version) != (first.model_id, first.weight_version):
                raise InvalidArgumentError(
                    f"{where}.weight_version: {m.model_id}@{m.weight_version} is not the update "
                    f"{first.model_id}@{first.weight_version} the shards before it belong to "
                    f"({context})")
        # One tensor in two shards: the chunk would load one of them and both would count as
        # loaded (the C++ executor refuses it the same way).
        seen = {_tensor_field(t, "name") for first in known for t in first.tensors}
        for i, t in enumerate(m.tensors):
            name = _tensor_field(t, "name")
            if name in seen:
                raise InvalidArgumentError(
                    f"{where}.tensors[{i}].name: \"{name}\" is in an earlier shard of this "
                    f"update too ({context})")

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

    def _default_loader(self, update_ids: str) -> Callable[[List[Tuple[str, Any]]], Any]:
        model = self.model
        if model is None:
            raise InvalidArgumentError("receive_weights: load_weights: missing, and the engine "
                                       "has no model to load into")
        if self._checkpoint_format and callable(getattr(model, "load_weights", None)):
            return model.load_weights
        return lambda weights: _copy_by_name(model, weights, update_ids)

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


def _copy_by_name(model: Any, weights: Iterable[Tuple[str, Any]], update_ids: str) -> None:
    """Kernel-format load: copies each tensor into the parameter or buffer of its name, which
    must have its shape and dtype (a silent cast would serve other weights than were sent)."""
    import torch

    where = f"load_weights (update_id={update_ids})"

    targets = dict(model.named_parameters())
    targets.update(model.named_buffers())
    with torch.no_grad():
        for name, tensor in weights:
            target = targets.get(name)
            if target is None:
                raise InvalidArgumentError(f"{where}: {name!r} is not a parameter or buffer of "
                                           "the model")
            if tuple(target.shape) != tuple(tensor.shape):
                raise InvalidArgumentError(f"{where}: {name!r}: shape {list(tensor.shape)} "
                                           f"differs from the model's {list(target.shape)}")
            if target.dtype != tensor.dtype:
                raise InvalidArgumentError(f"{where}: {name!r}: dtype {tensor.dtype} differs from "
                                           f"the model's {target.dtype}")
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
