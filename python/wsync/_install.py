"""Installers: how an executor's update gets into Python objects, in two steps.

``stage(update_id, shards)`` runs outside the generation gate and may fail (the previous version
stays); the switch runs under the exclusive side of the gate and only swaps references, so
readers wait for the switch alone, never for a copy. ViewInstaller switches in ``activate``;
ModuleInstaller exposes ``slots`` and the extension switches those itself (python_adapter in
python/src/common.hpp), through the C API, so a Ctrl-C cannot stop it half-way.
"""

import json
from typing import Dict, List, Optional, Tuple

import torch

from wsync import _torch, _wsync
from wsync._errors import InstallFailedError, InvalidArgumentError


def _update_tensors(shards) -> Dict[str, torch.Tensor]:
    views: Dict[str, torch.Tensor] = {}
    for manifest, segments in shards:
        _torch.views_of(manifest, segments, views)
    return views


class ViewInstaller:
    """No runtime: the active weights are the imported views themselves (zero-copy). The
    executor keeps the import until the next version is active."""

    references_import = True
    # The extension makes the switch itself (active = _staged.pop(update_id)) with C calls
    # only, so a Ctrl-C cannot fall between the executor's switch and this one; activate()
    # below is what it does, for callers outside an executor.
    _switch_views = True

    def __init__(self) -> None:
        self.active: Dict[str, torch.Tensor] = {}
        self._staged: Dict[str, Dict[str, torch.Tensor]] = {}

    def stage(self, update_id: str, shards) -> None:
        self._staged[update_id] = _update_tensors(shards)

    def activate(self, update_id: str) -> None:
        self.active = self._staged.pop(update_id)

    def discard(self, update_id: str) -> None:
        self._staged.pop(update_id, None)


class ModuleInstaller:
    """Installs into a torch.nn.Module's parameters and buffers (its state_dict names).

    stage() checks the update against the module (names, shapes, dtypes: the first mismatch
    fails the install) and has the extension copy it, without the GIL, into a spare set of
    tensors beside the active one;
    the switch (the extension's, over ``slots``) points each parameter's ``.data`` at the spare
    set, which then holds the previous version and becomes the next spare. Tied tensors (one tensor under two names) stay
    tied. Memory: one extra copy of the model.
    """

    references_import = False

    def __init__(self, model: torch.nn.Module) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
        self.model = model
        self.targets: Dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))
        for name, t in self.targets.items():
            if t.device.type not in ("cpu", "cuda"):
                raise InvalidArgumentError(
                    f"model: tensor {name}: field device: {t.device}; wsync installs into CPU "
                    "and CUDA tensors")
        # Where this module cannot drive the GPU (built without CUDA), torch copies into CUDA
        # tensors instead; asked once, it does not change while the process runs.
        self._torch_copies = (any(t.device.type == "cuda" for t in self.targets.values())
                              and bool(_wsync.gpu_ready()))
        # One slot per distinct tensor: tied names share it.
        self._slot_of: Dict[str, int] = {}
        self._slot_tensor: List[torch.Tensor] = []
        self.slots = self._slot_tensor  # the extension switches these (python_adapter)
        by_id: Dict[int, int] = {}
        for name, t in self.targets.items():
            key = id(t)
            if key not in by_id:
                by_id[key] = len(self._slot_tensor)
                self._slot_tensor.append(t)
            self._slot_of[name] = by_id[key]
        self._spare: Optional[List[torch.Tensor]] = None
        self._active: Optional[List[torch.Tensor]] = None  # what the slots point at now
        self._staged: Dict[str, List[torch.Tensor]] = {}
        self.active_update: Optional[str] = None
        self.rank = -1  # the consumer rank its errors name (RolloutExecutor sets it)

    def _where(self, update_id: str) -> str:
        return f"update_id={update_id} rank={self.rank}"

    def check(self, update_id: str, found: Dict[str, Tuple[str, list]]) -> None:
        """InstallFailedError naming the first difference between the update (name -> (wire
        dtype, shape)) and the module."""
        where = self._where(update_id)
        for name, target in self.targets.items():
            got = found.get(name)
            if got is None:
                raise InstallFailedError(f"install: tensor {name}: missing from the update "
                                         f"({where})")
            dtype, shape = got
            if list(shape) != list(target.shape):
                raise InstallFailedError(
                    f"install: tensor {name}: field shape: update has {list(shape)}, the model "
                    f"has {list(target.shape)} ({where})")
            want = _torch.wire_dtype(name, target)
            if dtype != want:
                raise InstallFailedError(
                    f"install: tensor {name}: field dtype: update has {dtype}, the model has "
                    f"{want} ({where})")
        for name in found:
            if name not in self.targets:
                raise InstallFailedError(f"install: tensor {name}: not in the model ({where})")

    def _check_tied(self, update_id: str, shards, digests: Dict[str, Tuple[int, int]]) -> None:
        """Names the model ties to one tensor get one copy (the first name's bytes): the update
        must send the same bytes under each, or the model would serve other weights than were
        sent. Equal bytes have equal checksums under one checksum method."""
        methods: Dict[int, list] = {}

        def method(shard: int) -> list:
            if shard not in methods:
                fields = json.loads(shards[shard][0].to_json())
                methods[shard] = sorted((k, str(v)) for k, v in fields.items()
                                        if k.startswith("checksum"))
            return methods[shard]

        first_of: Dict[int, str] = {}
        for name, slot in self._slot_of.items():
            first = first_of.setdefault(slot, name)
            if first == name:
                continue
            (k0, c0), (k1, c1) = digests[first], digests[name]
            if c0 != c1 and (k0 == k1 or method(k0) == method(k1)):
                raise InstallFailedError(
                    f"install: tensor {name}: field checksum: the model ties it to {first}, and "
                    f"the update sends different bytes for the two ({self._where(update_id)})")

    def stage(self, update_id: str, shards) -> List[tuple]:
        """Checks the update against the module and returns the copies into the spare set, for
        the extension to run without the GIL."""
        found: Dict[str, Tuple[str, list]] = {}
        where: Dict[str, tuple] = {}
        digests: Dict[str, Tuple[int, int]] = {}
        for k, (manifest, _segments) in enumerate(shards):
            for info in manifest.tensors:
                if info.strides:
                    raise InstallFailedError(f"install: tensor {info.name}: field strides: "
                                             "strided updates are not installed into modules "
                                             f"({self._where(update_id)})")
                found[info.name] = (info.dtype, info.shape)
                where[info.name] = (k, info.segment, info.offset, info.nbytes)
                digests[info.name] = (k, info.checksum)
        self.check(update_id, found)
        self._check_tied(update_id, shards, digests)
        # The slots are the module's tensors as they were when the executor was made: one the
        # module replaced since (a buffer after model.to(), an assignment) would take the bytes
        # while the module reads another.
        now = self.model.state_dict(keep_vars=True)
        for name, slot in self._slot_of.items():
            if now.get(name) is not self._slot_tensor[slot]:
                raise InstallFailedError(
                    f"install: tensor {name}: field tensor: the module's tensor was replaced "
                    "after the RolloutExecutor was made (model.to(), .cuda(), .double() or an "
                    "assignment); make the executor after such changes "
                    f"({self._where(update_id)})")
        # Spares are plain row-major tensors on each slot's device and dtype (the copies are byte
        # copies): a slot whose previous tensor had another layout (channels_last, a transposed
        # view) or place gets a fresh one.
        spare = self._spare or [None] * len(self._slot_tensor)
        spare = [s if s is not None and s.is_contiguous() and s.device == t.device
                 and s.dtype == t.dtype and s.shape == t.shape else
                 torch.empty(t.shape, dtype=t.dtype, device=t.device)
                 for s, t in zip(spare, self._slot_tensor)]
        jobs = []
        done = set()
        for name, slot in self._slot_of.items():
            if slot in done:  # a tied tensor: one copy
                continue
            done.add(slot)
            dest = spare[slot]
            shard, segment, offset, nbytes = where[name]
            if nbytes != dest.numel() * dest.element_size():
                raise InstallFailedError(f"install: tensor {name}: field nbytes: {nbytes} "
                                         "does not match its shape and dtype "
                                         f"({self._where(update_id)})")
            if not nbytes:
                continue
            device = _torch.cuda_index(dest)
            if device >= 0 and self._torch_copies:
                _torch.copy_bytes(dest, shards[shard][1][segment], offset, nbytes)
            else:
                jobs.append((dest.data_ptr(), shard, segment, offset, nbytes, device))
        self._spare = None
        self._staged[update_id] = spare
        return jobs

    def discard(self, update_id: str) -> None:
        staged = self._staged.pop(update_id, None)
        if staged is not None and self._spare is None:
            self._spare = staged
