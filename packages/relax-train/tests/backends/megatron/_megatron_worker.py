"""One rank of a megatron-backend test, run as its own process (megatron-core's parallel state is global
to a process): ``python _megatron_worker.py SPEC_JSON OUT_PT``. The spec names the model, the run flags,
the samples and what to do; rank 0 writes the results to OUT_PT.

``python _megatron_worker.py --serve``: one rank that runs specs one after another, each read from stdin
as ``SPEC_JSON OUT_PT MASTER_PORT`` (the same line to every rank of the group), answering each with a
line ``@@done ok`` or ``@@done fail`` (the traceback in ``OUT_PT.err.rank<R>``). Importing megatron-core
takes ~15 s a process here, more than most runs take; every run sets up and leaves torch.distributed and
megatron's parallel state itself, so the next starts from none."""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch

warnings.filterwarnings("ignore")


def main(spec_path: str, out_path: str) -> None:
    import os

    from relax_app.cli_config import build_config
    from relax_train.backends import TrainBackend
    from relax_train.backends.megatron.backend import MegatronBackend

    spec = json.loads(open(spec_path).read())
    torch.set_num_threads(1)
    cfg = build_config(None, ["--prompt-data", "unused", "--hf-checkpoint", spec["model"], *spec["flags"]])
    samples = torch.load(spec["samples"], weights_only=False)
    backend = MegatronBackend(cfg, spec["model"])
    assert isinstance(backend, TrainBackend), "MegatronBackend no longer satisfies TrainBackend"
    if spec.get("streams"):  # would the trainer train this backend's batches part by part as they arrive?
        from relax_train.roles.stream import streams_training

        out_streams = streams_training(cfg, backend)
    out: dict = {"logp": backend.compute_log_probs(samples)}
    if spec.get("streams"):
        out["streams"] = out_streams
    for _ in range(spec.get("train_steps", 0)):
        out.setdefault("metrics", []).append(backend.train_step(samples))
    # (copies: for unfused tensors named_weights() gives views of the live parameters)
    out["weights"] = {n: t.clone() for n, t in backend.named_weights()}
    if spec.get("offload"):  # colocate's hand-over: the device memory out and back, between two steps
        out["offload"] = _offload_round_trip(backend, samples)
    if spec.get("save"):
        backend.save_checkpoint(spec["save"])
    if spec.get("load"):
        out["meta"] = backend.load_checkpoint(spec["load"])
        out["weights_loaded"] = {n: t.clone() for n, t in backend.named_weights()}
    for _ in range(spec.get("then_train", 0)):  # after the save / load: the restored optimizer state at work
        out.setdefault("metrics_then", []).append(backend.train_step(samples))
    if spec.get("then_train"):
        out["weights_then"] = dict(backend.named_weights())
    out["logp_after"] = backend.compute_log_probs(samples)
    groups = backend.optimizer.param_groups if backend.trainable else []
    out["optimizer_params"] = sum(len(g["params"]) for g in groups)
    out["params"] = len(list(backend.model.parameters()))
    if spec.get("publish_dtype"):  # what a run with --dtype X publishes to the rollout: X
        backend.cfg.model.dtype = spec["publish_dtype"]
        out["weights_published"] = dict(backend.named_weights())
    rank = int(os.environ.get("RANK", 0))
    # how many weights each rank holds after named_weights(): the whole model on rank 0 only
    with open(f"{out_path}.rank{rank}.weights", "w") as f:
        f.write(str(len(backend.named_weights())))
    if rank == 0:
        torch.save(out, out_path)
    _leave()


def _offload_round_trip(backend, samples) -> dict:
    """What colocate's ``--offload`` does between a trainer's turns: the bytes it frees, the device memory
    allocated before, in between and after (0 without CUDA), and the log-probs before and after."""
    from relax_train.backends.state import device_tensors

    cuda = torch.cuda.is_available()

    def allocated() -> int:
        return torch.cuda.memory_allocated() if cuda else 0

    logp, before = backend.compute_log_probs(samples), allocated()
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in device_tensors(backend.model, backend.optimizer)
        if t.is_cuda
    }
    freed = backend.offload()
    offloaded = allocated()
    restored = backend.onload()
    return {
        "logp": logp,
        "freed": freed,
        "restored": restored,
        "on_gpu": sum(storages.values()),
        "allocated": [before, offloaded, allocated()],
        "logp_after": backend.compute_log_probs(samples),
    }


def _leave() -> None:
    """Leave the process group together before exiting: a rank whose peer is already gone can abort in
    gloo's teardown (``terminate called without an active exception``) after all its work is done."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if dist.is_initialized():
        dist.barrier()
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def serve() -> None:
    import traceback

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    for line in sys.stdin:
        spec_path, out_path, port = line.split()
        os.environ["MASTER_PORT"] = port  # (a fresh rendezvous for every run)
        try:
            main(spec_path, out_path)
            status = "ok"
        except BaseException:  # noqa: BLE001 - the test's to see
            with open(f"{out_path}.err.rank{os.environ.get('RANK', 0)}", "w") as f:
                f.write(traceback.format_exc())
            status = "fail"
        finally:
            if dist.is_initialized():  # (a run that failed part-way: nothing carries over)
                ps.destroy_model_parallel()
                dist.destroy_process_group()
        print(f"@@done {status}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        main(sys.argv[1], sys.argv[2])
