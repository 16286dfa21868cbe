#!/usr/bin/python3
# A rollout rank that generates with whatever version the trainer last committed.
#
# wsync.RolloutRank joins the coordinator and, in a background thread, installs every version the
# coordinator sends into the module: import, verify the checksums, copy into a spare set of
# tensors, then switch by reference. Each `with rank.generating():` block sees one whole version
# from start to end; an install waits for the blocks in flight and blocks the next ones only for
# the switch itself. examples/python/trainer.py is the other side; its header shows the whole
# run:
#
#   export PYTHONPATH=$PWD/build/default/python
#   export WSYNC_TOKEN=$(head -c16 /dev/urandom | od -An -tx1 | tr -d ' \n')
#   rm -f /tmp/wsync-port
#   build/default/apps/wsync coordinator --port-file /tmp/wsync-port & coordinator=$!
#   until [ -s /tmp/wsync-port ]; do sleep 0.1; done
#   export WSYNC_COORDINATOR=127.0.0.1:$(cat /tmp/wsync-port)
#   /usr/bin/python3 examples/python/rollout.py --rank 0 --until-version 20 & r0=$!
#   /usr/bin/python3 examples/python/rollout.py --rank 1 --until-version 20 & r1=$!
#   /usr/bin/python3 examples/python/trainer.py --rollouts 2 --steps 20
#   wait $r0 $r1; kill $coordinator
#
# Without --until-version it runs until Ctrl-C or SIGTERM, and leaves the cluster cleanly either
# way. A rank that joins while the trainer runs gets the newest committed version at once (with
# shared memory the bytes live in the trainer's process: after it exits there is nothing to get).

import argparse
import os
import signal
import sys
import time

import torch

import wsync

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trainer import SEQ, TinyLM, fingerprint  # noqa: E402  (the same architecture as the trainer)


def generate(model: torch.nn.Module, prompt: list, new_tokens: int) -> list:
    """Greedy decoding: one generation step, run under one version."""
    tokens = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(new_tokens):
            nxt = model(tokens[:, -SEQ:])[0, -1].argmax()
            tokens = torch.cat([tokens, nxt.view(1, 1)], dim=1)
    return tokens[0, len(prompt):].tolist()


def main() -> int:
    p = argparse.ArgumentParser(
        description="Keep a tiny LM on the newest committed version and generate with it "
                    "(examples/python/trainer.py's header shows the whole run).")
    p.add_argument("--coordinator", default=None,
                   help="host:port of `wsync coordinator` (default: $WSYNC_COORDINATOR)")
    p.add_argument("--rank", type=int, default=None,
                   help="this rollout rank (default: $RANK, $SLURM_PROCID, else 0)")
    p.add_argument("--until-version", type=int, default=None,
                   help="exit once this version is active (default: run until Ctrl-C)")
    p.add_argument("--transport", default="shared-memory",
                   help="data plane: shared-memory (one host), file-mmap, ucx")
    p.add_argument("--model-id", default="tiny-lm", help="the model's name in the cluster")
    p.add_argument("--prompt", default="3,4,5", help="comma-separated token ids to continue")
    p.add_argument("--interval", type=float, default=0.05,
                   help="seconds to sleep between generation steps")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="give up when --until-version is not active within this many seconds")
    args = p.parse_args()

    torch.set_num_threads(1)
    # SIGTERM ends the rank like Ctrl-C does: `with` leaves the cluster and releases the update.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    prompt = [int(t) for t in args.prompt.split(",")]
    torch.manual_seed(1234)  # deliberately not the trainer's weights: they come from the trainer
    model = TinyLM().eval()
    deadline = time.monotonic() + args.timeout

    with wsync.RolloutRank(args.coordinator, model=model, rank=args.rank,
                           transport=args.transport, model_id=args.model_id) as rank:
        print(f"rollout {rank.rank}: joined; serving version {rank.active_weight_version}",
              flush=True)
        last = None
        while True:
            with rank.generating() as waited:
                # Everything in here sees one whole version of the weights, and the version
                # read here is the one those weights are.
                version = rank.active_weight_version
                out = generate(model, prompt, 6) if version else None
                if version != last:
                    print(f"rollout {rank.rank}: v{version} {prompt} -> {out} "
                          f"fingerprint {fingerprint(model):.6f} (waited {waited * 1e3:.2f} ms)",
                          flush=True)
                    last = version
            if args.until_version is not None:
                if version >= args.until_version:
                    break
                if time.monotonic() > deadline:
                    print(f"rollout {rank.rank}: version {args.until_version} not active within "
                          f"{args.timeout} s; last update: {rank.status()['last_update']}",
                          file=sys.stderr)
                    return 1
            time.sleep(args.interval)
        s = rank.status()
        print(f"rollout {rank.rank}: done at v{s['active_weight_version']}: {s['installed']} "
              f"installed, {s['rejected']} rejected, longest gate wait "
              f"{s['longest_gate_wait_s'] * 1e3:.2f} ms over {s['generations']} generation steps",
              flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("rollout: stopped", file=sys.stderr)
        sys.exit(0)
    except wsync.WeightSyncError as e:  # the message names what failed and why
        print(f"rollout: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
