#!/usr/bin/python3
# The bridge API in one process: publish, import_update, acknowledge or reject, release; then the
# RolloutExecutor that does all of it in one call. Code written for RL-Kernel's bridges runs with
# its imports changed to these (docs/python.md, "Switching from RL-Kernel").
#
#   PYTHONPATH=build/default/python /usr/bin/python3 examples/python/bridge.py
#   PYTHONPATH=build/default/python /usr/bin/python3 examples/python/bridge.py \
#       --transport local-clone    # or file-mmap (--dir DIR, default a temporary one)
#
# In real use the trainer and the rollout worker are separate processes on one host, and the
# manifest travels between them any way you like (it pickles, and converts to and from JSON).

import argparse
import gc
import pickle
import shutil
import sys
import tempfile

import torch

import wsync
from wsync import RolloutExecutor, SharedMemoryTensorBridge, make_weight_bridge


def small_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4),
                               torch.nn.LayerNorm(4))


def main() -> int:
    p = argparse.ArgumentParser(description="The wsync bridge lifecycle and the rollout executor "
                                            "in one process.")
    p.add_argument("--transport", default="shared-memory",
                   choices=["shared-memory", "local-clone", "file-mmap"],
                   help="data plane (default: shared-memory)")
    p.add_argument("--dir", default=None,
                   help="file-mmap's directory (default: a fresh temporary one)")
    args = p.parse_args()
    options = {}
    if args.transport == "file-mmap":
        options["dir"] = args.dir or tempfile.mkdtemp(prefix="wsync-bridge-")

    def bridge(worker: str):
        if args.transport == "shared-memory":
            return SharedMemoryTensorBridge(source_worker=worker, source_rank=0)
        return make_weight_bridge(args.transport, source_worker=worker, source_rank=0,
                                  options=options)

    try:
        return run(bridge)
    finally:
        if args.transport == "file-mmap" and args.dir is None:
            shutil.rmtree(options["dir"], ignore_errors=True)


def run(bridge) -> int:

    trainer = small_model(1)
    publisher, consumer = bridge("trainer"), bridge("rollout")

    # 1. Publish a version, import it, install it, acknowledge, release.
    manifest = publisher.publish(trainer, weight_version=1,
                                 metadata={"step": 1, "layout": {"kind": "full-state"}})
    print(manifest)
    print("  metadata travels as text:", dict(manifest.metadata))
    assert pickle.loads(pickle.dumps(manifest)) == manifest
    assert wsync.Manifest.from_json(manifest.to_json()) == manifest

    rollout_model = small_model(2)
    try:
        tensors = consumer.import_update(manifest)  # checksums verified; views, no copy
        rollout_model.load_state_dict(tensors)      # "install": here, a copy into the module
        consumer.acknowledge(manifest.update_id)
        print("  imported", len(tensors), "tensors; state:", consumer.state(manifest.update_id))
    finally:
        consumer.release(manifest.update_id)
        publisher.release(manifest.update_id)
    same = all(torch.equal(a, b) for a, b in
               zip(trainer.state_dict().values(), rollout_model.state_dict().values()))
    print("  rollout model equals trainer:", same)

    # The imported views outlived the release above: the memory stays until the last one goes.
    print("  releases waiting for views:", len(wsync.releases_pending()))
    del tensors
    gc.collect()
    print("  after dropping the views:", len(wsync.releases_pending()))

    # 2. An update the runtime cannot take: reject it with the reason, then release.
    wrong = {**trainer.state_dict(), "0.weight": torch.zeros(8, 8)}
    manifest = publisher.publish(wrong, weight_version=2)
    tensors = consumer.import_update(manifest)
    try:
        rollout_model.load_state_dict(tensors)
        consumer.acknowledge(manifest.update_id)
    except RuntimeError as e:
        reason = " ".join(str(e).split())
        consumer.reject(manifest.update_id, reason)
        print("v2:", consumer.state(manifest.update_id), "-", reason[:110])
    del tensors
    consumer.release(manifest.update_id)
    publisher.release(manifest.update_id)

    # Versions only grow; wsync says so in an error of its own class.
    try:
        publisher.publish(trainer, weight_version=2)
    except wsync.VersionNotMonotonicError as e:
        print("v2 again:", type(e).__name__, "-", str(e).split(" (")[0])

    # 3. The rollout executor: import, verify, install into the module, acknowledge, switch
    #    readers over under the generation gate, release the previous update. On failure it
    #    rejects, releases the new update and keeps the previous version.
    executor = RolloutExecutor(weight_bridge=bridge("rollout"), model=rollout_model)
    x = torch.randn(3, 16)
    for version in (3, 4, 5):
        with torch.no_grad():
            for param in trainer.parameters():
                param.add_(0.01)
        state = trainer.state_dict()
        if version == 4:  # a tensor the rollout model does not have
            state = {**state, "extra.bias": torch.zeros(2)}
        manifest = publisher.publish(state, weight_version=version)
        try:
            executor.update_weights(manifest)
            report = executor.last_report  # what the last update did, with its timings
            assert report is not None
            print(f"v{version}: active {executor.active_weight_version}, "
                  f"install {report['timings']['install'] * 1e3:.2f} ms")
        except wsync.InstallFailedError as e:
            print(f"v{version}: {type(e).__name__} - {str(e).split(' (')[0]}; "
                  f"active stays {executor.active_weight_version}")
        publisher.release(manifest.update_id)
        with executor.generating(), torch.no_grad():  # a generation step sees one whole version
            out = rollout_model(x)
    expected = trainer(x).detach()
    print("rollout output equals trainer's:", torch.equal(out, expected))
    executor.release_weights()

    # 4. model=None keeps the imported tensors themselves as the active weights: with
    #    shared-memory these are read-only views of the mapping (no copy at all).
    viewer = RolloutExecutor(weight_bridge=bridge("rollout"))
    manifest = publisher.publish(trainer, weight_version=6)
    active = viewer.update_weights(manifest)
    print(f"executor without a model: v{viewer.active_weight_version}, {len(active)} imported "
          f"tensors active")
    del active
    viewer.release_weights()
    publisher.release(manifest.update_id)
    gc.collect()

    left = wsync.releases_pending()
    print("releases still waiting:", left)
    return 0 if same and not left and torch.equal(out, expected) else 1


if __name__ == "__main__":
    sys.exit(main())
