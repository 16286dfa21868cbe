#!/usr/bin/python3
# A trainer that publishes every optimizer step to rollout ranks through a wsync coordinator.
#
# It trains a tiny language model (defined below) to continue counting: after 3 4 5 comes 6.
# After each step, each trainer rank publishes its share of the weights as the next version and
# waits for the outcome: committed once every rollout rank answered and at least one installed it.
# examples/python/rollout.py is the other side.
#
# Run from the repository root after `bash scripts/run.sh` (or any build into build/default):
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
# Two trainer ranks (data parallel over gloo; each publishes half of the tensors), in place of
# the last-but-one line:
#
#   /usr/bin/python3 -m torch.distributed.run --standalone --nproc_per_node 2 \
#       --redirects 1 --tee 1 examples/python/trainer.py --rollouts 2 --steps 20
#
# (--redirects 1 --tee 1 only because Debian 12's torch 1.13 cannot parse its own default "0"
# under Python 3.11; a newer torchrun needs neither. It also keeps per-rank logs in
# /tmp/torchelastic_*.)
#
# Versions must grow for the coordinator's whole life: a second run against the same coordinator
# needs --first-version 21 (or a fresh coordinator). Use Debian's /usr/bin/python3: it is the
# interpreter the module was built for and the one that sees python3-torch (docs/python.md).

import argparse
import os
import sys
import time

import torch

import wsync

VOCAB = 32
SEQ = 16


class TinyLM(torch.nn.Module):
    """A two-block causal transformer with its output head tied to the embedding."""

    def __init__(self, dim: int = 48, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.pos = torch.nn.Embedding(SEQ, dim)
        self.blocks = torch.nn.ModuleList([
            torch.nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
            for _ in range(layers)])
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied: one tensor, two names in the state dict

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        x = self.embed(tokens) + self.pos(torch.arange(n))
        mask = torch.triu(torch.full((n, n), float("-inf")), 1)
        for block in self.blocks:
            x = block(x, src_mask=mask)
        return self.head(self.norm(x))


def fingerprint(model: torch.nn.Module) -> float:
    """A number that changes with every byte of the weights; rollout.py prints the same one."""
    return float(sum(t.double().sum() for t in model.state_dict().values()))


def counting_batch(size: int, gen: torch.Generator) -> torch.Tensor:
    start = torch.randint(0, VOCAB, (size, 1), generator=gen)
    return (start + torch.arange(SEQ)) % VOCAB


def main() -> int:
    p = argparse.ArgumentParser(
        description="Train a tiny LM and publish every optimizer step through a wsync "
                    "coordinator (the header of this file shows the whole run).")
    p.add_argument("--coordinator", default=None,
                   help="host:port of `wsync coordinator` (default: $WSYNC_COORDINATOR)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps, one version each")
    p.add_argument("--first-version", type=int, default=1,
                   help="weight_version of the first step; versions must grow per coordinator")
    p.add_argument("--rollouts", type=int, default=1,
                   help="rollout ranks to wait for before training (0: do not wait)")
    p.add_argument("--transport", default="shared-memory",
                   help="data plane: shared-memory (one host), file-mmap, ucx")
    p.add_argument("--model-id", default="tiny-lm", help="the model's name in the cluster")
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    args = p.parse_args()

    torch.set_num_threads(1)
    rank, ranks = wsync.launch_rank(), wsync.launch_world_size()
    if ranks > 1:  # started by torchrun: data parallel, so every rank holds the same weights
        torch.distributed.init_process_group("gloo")
    torch.manual_seed(0)
    model = TinyLM()
    trained = torch.nn.parallel.DistributedDataParallel(model) if ranks > 1 else model
    opt = torch.optim.AdamW(trained.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(1000 + rank)

    if args.rollouts > 0:
        print(f"trainer {rank}: waiting for {args.rollouts} rollout rank(s)", flush=True)
        wsync.wait_for_consumers(args.rollouts, coordinator=args.coordinator, timeout=120)

    aborted = 0
    # TrainerRank reads RANK / WORLD_SIZE (torchrun) and WSYNC_TOKEN itself. It publishes
    # `model`, not the DDP wrapper, so the names are those of the rollout's TinyLM.
    with wsync.TrainerRank(args.coordinator, model=model, transport=args.transport,
                           model_id=args.model_id) as trainer:
        for step in range(args.steps):
            tokens = counting_batch(args.batch, data)
            logits = trained(tokens)[:, :-1]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                     tokens[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()

            version = args.first_version + step
            t0 = time.monotonic()
            # Blocks until the coordinator decided; the weights must not change until then.
            outcome = trainer.publish(weight_version=version,
                                      metadata={"step": step, "loss": round(loss.item(), 4)})
            took = time.monotonic() - t0
            acks = sum(1 for r in outcome.ranks if r.get("acknowledged"))
            if outcome.committed:
                print(f"trainer {rank}: v{version} loss {loss.item():.3f} committed "
                      f"({acks} acknowledged, publish {outcome.publish_s * 1e3:.1f} ms, "
                      f"round trip {took * 1e3:.1f} ms) fingerprint {fingerprint(model):.6f}",
                      flush=True)
            else:
                # The rollouts keep serving the previous version; training goes on.
                aborted += 1
                print(f"trainer {rank}: v{version} aborted: {outcome.reason}", flush=True)
                for r in outcome.ranks:
                    print(f"    rank {r.get('rank')}: {r.get('state')} {r.get('reason', '')}",
                          flush=True)
    if ranks > 1:
        torch.distributed.destroy_process_group()
    return 1 if aborted else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print(f"trainer {os.environ.get('RANK', 0)}: interrupted", file=sys.stderr)
        sys.exit(130)
    except wsync.WeightSyncError as e:  # the message names what failed and why
        print(f"trainer: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
