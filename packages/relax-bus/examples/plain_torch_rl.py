"""A plain PyTorch RL loop driven by relax-bus, nothing else from Relax.

A tiny policy learns to emit token 3: a rollout thread samples 4 responses per prompt (GRPO groups), an
advantages thread normalises rewards within each group, the trainer streams micro-batches and updates.
max_staleness=1: rollout may run one step ahead of the trainer, never more (admit blocks it).

    python examples/plain_torch_rl.py --steps 20
"""

import argparse
import threading

import numpy as np
import torch

from relax_bus import BusClosed, BusConfig, ConsumerSpec, DataBus, StreamingDataLoader

VOCAB, LEN, GROUP, PROMPTS = 8, 6, 4, 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    steps = ap.parse_args().steps
    torch.manual_seed(0)
    policy = torch.nn.Linear(1, VOCAB)
    opt = torch.optim.Adam(policy.parameters(), lr=0.1)
    lock = threading.Lock()
    bus = DataBus(
        BusConfig(
            consumers={
                "advantages": ConsumerSpec(required_fields=["reward"], sampler="group"),
                "train": ConsumerSpec(required_fields=["advantage"], sampler="group", enforce_staleness=True),
            },
            capacity=256,
            max_staleness=1,
            group_size=GROUP,
        )
    )

    def rollout() -> None:
        try:
            for step in range(steps):
                version = bus.admit(step)
                with lock, torch.no_grad():
                    probs = torch.softmax(policy(torch.ones(1, 1)), -1)[0]
                toks = torch.multinomial(probs, PROMPTS * GROUP * LEN, replacement=True).view(-1, LEN).numpy()
                bus.put(
                    [
                        {
                            "group_id": (step, i // GROUP),
                            "policy_version": version,
                            "tokens": t,
                            "reward": float((t == 3).mean()),
                        }
                        for i, t in enumerate(toks)
                    ],
                    partition=f"step{step}",
                )
        except BusClosed:
            pass

    def advantages() -> None:
        try:
            while True:
                b = bus.get("advantages", GROUP)
                r = np.array(b.data["reward"])
                bus.add_fields(b.ids, {"advantage": list((r - r.mean()) / (r.std() + 1e-6))})
                bus.ack("advantages", b.lease_id)
        except BusClosed:
            pass

    threads = [threading.Thread(target=f, daemon=True) for f in (rollout, advantages)]
    for t in threads:
        t.start()
    for step in range(steps):
        total = 0.0
        loader = StreamingDataLoader(
            bus,
            "train",
            micro_batch_size=2 * GROUP,
            total=PROMPTS * GROUP,
            fields=["tokens", "advantage"],
            trainer_version=step,
        )
        for mb in loader:  # starts while rollout is still writing the step
            with lock:
                logp = torch.log_softmax(policy(torch.ones(1, 1)), -1)[0][mb["tokens"]].sum(-1)
                loss = -(logp * mb["advantage"].float()).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            total += float(loss)
        bus.set_trainer_version(step + 1)
        with torch.no_grad():
            p3 = torch.softmax(policy(torch.ones(1, 1)), -1)[0, 3].item()
        print(
            f"step {step}: loss {total:.3f}  p(token 3) {p3:.2f}  staleness {bus.stats()['staleness_hist']}"
        )
    bus.close()
    for t in threads:  # they end on BusClosed; exiting while one is inside torch can abort the process
        t.join(timeout=30)


if __name__ == "__main__":
    main()
