"""The processes of the end-to-end cluster test: a trainer that trains a small decoder and
publishes every step, and rollout ranks that install each version and compute logits.

    cluster_roles.py trainer OUT_DIR STEPS ROLLOUTS
    cluster_roles.py rollout OUT_DIR STEPS RANK
    cluster_roles.py crash-trainer OUT_DIR BYTES
    cluster_roles.py resumed-trainer OUT_DIR BYTES
    cluster_roles.py blob-rollout OUT_DIR BYTES

The coordinator and token come from WSYNC_COORDINATOR / WSYNC_TOKEN. The trainer and rollout
roles put their models on WSYNC_TEST_DEVICE (default cpu) and move updates over
WSYNC_TEST_TRANSPORT (default shared-memory): test_cuda.py runs them on the GPU.
"""

import os
import sys
import time

import torch

import wsync

VOCAB, DIM, HEADS, LAYERS, SEQ = 96, 32, 4, 2, 12
DEVICE = os.environ.get("WSYNC_TEST_DEVICE", "cpu")
TRANSPORT = os.environ.get("WSYNC_TEST_TRANSPORT", "shared-memory")


class Decoder(torch.nn.Module):
    """Embedding, two causal transformer blocks, a final norm and an LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList([
            torch.nn.TransformerEncoderLayer(DIM, HEADS, 4 * DIM, dropout=0.0, batch_first=True)
            for _ in range(LAYERS)])
        self.norm = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((SEQ, SEQ), float("-inf")), 1))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, src_mask=self.mask)
        return self.head(self.norm(x))


def fixed_batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(123))


def logits_of(model: torch.nn.Module) -> torch.Tensor:
    """The model's logits on the fixed batch, in host memory."""
    model.eval()
    with torch.no_grad():
        return model(fixed_batch().to(DEVICE)).cpu()


def weights_of(model: torch.nn.Module) -> dict:
    """A host copy of every tensor of the model's state."""
    return {k: t.detach().to("cpu", copy=True) for k, t in model.state_dict().items()}


def wait_for(path: str, limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {limit} s")
        time.sleep(0.01)


def trainer(out: str, steps: int, rollouts: int) -> None:
    torch.manual_seed(0)
    model = Decoder().to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(7)
    wsync.wait_for_consumers(rollouts, timeout=60)
    refs, weights = {}, {}
    with wsync.TrainerRank(model=model, transport=TRANSPORT) as rank:
        for v in range(1, steps + 1):
            model.train()
            tokens = torch.randint(0, VOCAB, (8, SEQ), generator=data).to(DEVICE)
            loss = torch.nn.functional.cross_entropy(
                model(tokens)[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            outcome = rank.publish(weight_version=v, metadata={"step": v, "loss": loss.item()})
            if not outcome.committed:
                raise SystemExit(f"version {v} aborted: {outcome.reason} {outcome.ranks}")
            refs[v] = logits_of(model)
            weights[v] = weights_of(model)
            for r in range(rollouts):
                wait_for(os.path.join(out, f"r{r}-v{v}"))
    torch.save(refs, os.path.join(out, "trainer.pt"))
    torch.save(weights, os.path.join(out, "trainer-weights.pt"))


def rollout(out: str, steps: int, rank: int) -> None:
    torch.manual_seed(100 + rank)
    model = Decoder().to(DEVICE).eval()
    seen, weights = {}, {}
    with wsync.RolloutRank(model=model, rank=rank, transport=TRANSPORT) as r:
        open(os.path.join(out, f"r{rank}-ready"), "w").close()
        for v in range(1, steps + 1):
            r.wait_for_version(v, timeout=120)
            with r.generating():
                assert r.active_weight_version == v, (r.active_weight_version, v)
                seen[v] = logits_of(model)
                weights[v] = weights_of(model)
            open(os.path.join(out, f"r{rank}-v{v}"), "w").close()
        status = r.status()
    torch.save({"logits": seen, "weights": weights, "status": status},
               os.path.join(out, f"rollout{rank}.pt"))


class Blob(torch.nn.Module):
    """16 flat parameters of `nbytes` in all: big enough that publishing takes a while."""

    def __init__(self, nbytes: int, value: float) -> None:
        super().__init__()
        for i in range(16):
            self.register_parameter(f"p{i}", torch.nn.Parameter(
                torch.full((nbytes // 4 // 16,), value), requires_grad=False))


def crash_trainer(out: str, nbytes: int, resume: bool = False) -> None:
    wsync.wait_for_consumers(1, timeout=60)
    with wsync.TrainerRank() as rank:
        if resume:  # the restarted trainer goes on past the version that died with it
            if not rank.publish(Blob(nbytes, 3.0), weight_version=3).committed:
                raise SystemExit("version 3 aborted")
            return
        if not rank.publish(Blob(nbytes, 1.0), weight_version=1).committed:
            raise SystemExit("version 1 aborted")
        v2 = Blob(nbytes, 2.0)
        open(os.path.join(out, "publishing-v2"), "w").close()
        rank.publish(v2, weight_version=2)  # killed while in here
    raise SystemExit("the test should have killed this trainer")


def blob_rollout(out: str, nbytes: int) -> None:
    model = Blob(nbytes, 0.0)
    with wsync.RolloutRank(model=model, rank=0) as r:
        r.wait_for_version(1, timeout=120)
        wait_for(os.path.join(out, "done"))
        after_kill = r.active_weight_version
        ones = all(bool((p == 1.0).all()) for p in model.parameters())
        r.wait_for_version(3, timeout=120)
        threes = all(bool((p == 3.0).all()) for p in model.parameters())
        status = r.status()
    torch.save({"after_kill": after_kill, "ones": ones, "threes": threes, "status": status},
               os.path.join(out, "blob.pt"))


if __name__ == "__main__":
    torch.set_num_threads(1)
    role, out = sys.argv[1], sys.argv[2]
    if role == "trainer":
        trainer(out, int(sys.argv[3]), int(sys.argv[4]))
    elif role == "rollout":
        rollout(out, int(sys.argv[3]), int(sys.argv[4]))
    elif role == "crash-trainer":
        crash_trainer(out, int(sys.argv[3]))
    elif role == "resumed-trainer":
        crash_trainer(out, int(sys.argv[3]), resume=True)
    elif role == "blob-rollout":
        blob_rollout(out, int(sys.argv[3]))
    else:
        raise SystemExit(f"unknown role {role}")
