"""Peak memory of token log-probs and entropies, forward and backward (#51): the plain computation (the LM
head's logits [N, V], then ``TokenScorer.token_logp`` with entropies, as the trainer does) against
``chunked_token_logp`` (the logits a chunk of rows at a time, recomputed in backward), at Qwen's
151,936-token vocabulary.

    uv run python benchmarks/logprobs_memory.py          # N = 2,048 / 4,096 / 8,192, 3 repeats (~7 min)

Method: each variant runs in a fresh Python process (one forward and one backward of a loss mixing the
log-probs and the entropies with random per-token weights, hidden [N, H] and weight [V, H] both needing
gradients). The process makes its inputs, warms the kernels up on 8 tokens, resets the kernel's
high-water mark of resident memory (``/proc/self/clear_refs``), reads its resident set, runs, and reports
``ru_maxrss`` (that high-water mark) minus the resident set: the peak of what the computation itself held,
its gradients included, tensors going back to the OS as they are freed (glibc unmaps large blocks at
once). The plain variant is the trainer's computation without the model's [B, S, V] logits and the
gather of the response positions before it (which add to its peak, not to the chunked one's). The processes of one repeat are interleaved. A process that cannot
get its memory fails cleanly (``RLIMIT_DATA`` capped at ``--cap-gb``, default the available memory less
1.5 GB; the OOM killer would take another process) and is recorded as needing more than the cap. The
values and gradients of the two variants are compared at the largest N where the plain one ran.
Results in ``benchmarks/results/logprobs_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

MASKED = [151643, 151655, 151656]  # a few ids never sampled (as media placeholders are)
VARIANTS = ("plain", "chunked")


def _rss_bytes() -> int:
    """This process's resident set now."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _vm_data_bytes() -> int:
    """This process's data segment now (what ``RLIMIT_DATA`` counts, touched or not)."""
    line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith("VmData"))
    return int(line.split()[1]) * 1024


def _reset_peak() -> bool:
    """Reset the kernel's high-water mark of resident memory to the resident set now (Linux >= 4.0), so
    the warm-up's own peak is not counted; False where it cannot (then ``ru_maxrss`` may include it)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _inputs(args):
    """Hidden [N, H], weight [V, H] (logits of a few units, as a trained head's), targets (none masked) and
    the loss's per-token weights, the same for every variant."""
    import torch

    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    hidden = torch.randn(args.tokens, args.hidden, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * 3 / args.hidden**0.5).to(dtype)
    weight.requires_grad_()
    targets = torch.randint(0, args.vocab - 1000, (args.tokens,), generator=g)
    a, b = torch.randn(args.tokens, generator=g), torch.randn(args.tokens, generator=g)
    return hidden, weight, targets, a, b


def _run(variant: str, hidden, weight, targets, temperature: float, chunk: int):
    """One forward (log-probs and entropies) of the variant; the two outputs."""
    from relax_train.backends.chunked_logprobs import chunked_token_logp
    from relax_train.backends.logprobs import TokenScorer

    if variant == "chunked":
        return chunked_token_logp(hidden, weight, targets, temperature, MASKED, chunk, with_entropy=True)
    logits = hidden @ weight.T  # the LM head's output, as the model returns it
    out = TokenScorer(temperature, MASKED).token_logp(logits, targets, with_entropy=True)
    del logits  # (the trainer drops the model's logits once scored; autograd keeps what it needs)
    return out


def worker(args) -> None:
    """One variant, one process: peak memory and time of its forward and backward (JSON on stdout)."""
    import torch

    torch.set_num_threads(args.threads)
    Path("/proc/self/oom_score_adj").write_text("1000")  # (if it comes to that, this process goes first)
    cap = int(args.cap_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    hidden, weight, targets, a, b = _inputs(args)
    for v in VARIANTS:  # warm the kernels up (8 tokens)
        h, w = hidden[:8].detach().requires_grad_(), weight.detach().requires_grad_()
        logp, ent = _run(v, h, w, targets[:8], args.temperature, 4)
        (logp.sum() + ent.sum()).backward()
    del h, w, logp, ent
    reset = _reset_peak()
    base, base_data = _rss_bytes(), _vm_data_bytes()
    t = time.perf_counter()
    try:
        logp, ent = _run(args.worker, hidden, weight, targets, args.temperature, args.chunk)
        ((a * logp).sum() + (b * ent).sum()).backward()
    except (RuntimeError, MemoryError) as e:  # the allocator's "not enough memory" under the cap
        # it needed more than the cap less the data segment it started from
        need = (cap - base_data) / 2**20
        print(json.dumps({"error": str(e).splitlines()[0][:200], "needs_more_than_mb": need}))
        return
    wall = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    if args.save:
        torch.save(
            {"logp": logp, "ent": ent, "grad_hidden": hidden.grad, "grad_weight": weight.grad}, args.save
        )
    print(
        json.dumps({"peak_mb": peak / 2**20, "wall_s": wall, "base_rss_mb": base / 2**20, "hwm_reset": reset})
    )


def _spawn(variant: str, tokens: int, args, save: str | None) -> dict:
    """The variant at N = ``tokens`` in a fresh process."""
    argv = [sys.executable, __file__, "--worker", variant, "--tokens-one", str(tokens)]
    for k in ("vocab", "hidden", "chunk", "threads", "temperature", "dtype", "cap_gb"):
        argv += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    if save:
        argv += ["--save", save]
    p = subprocess.run(argv, capture_output=True, text=True)
    if p.returncode != 0:
        return {"error": f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1:]}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def _diffs(plain: str, chunked: str) -> dict:
    """Max abs difference of each output and gradient, and the same over the plain one's largest magnitude."""
    import torch

    p, c = torch.load(plain), torch.load(chunked)
    out = {}
    for k in p:
        d = (p[k].float() - c[k].float()).abs().max().item()
        out[k] = {"max_abs": d, "relative_to_scale": d / max(1.0, p[k].float().abs().max().item())}
    return out


def _accuracy(args, tokens: int) -> dict:
    """Each variant's float32 values and gradients against a float64 computation of the plain formulas
    (written out here, since TokenScorer casts to float32), on ``tokens`` rows: max abs error over the
    reference's largest magnitude. Says which of two differing float32 results is the nearer."""
    import torch

    from relax_core.models import MASKED_LOGIT

    torch.set_num_threads(args.threads)
    hidden, weight, targets, a, b = _inputs(argparse.Namespace(**{**vars(args), "tokens": tokens}))

    def grads(variant: str, dtype: torch.dtype) -> dict:
        h, w = hidden.detach().to(dtype).requires_grad_(), weight.detach().to(dtype).requires_grad_()
        if dtype == torch.float64:
            z = h @ w.T
            z[:, MASKED] = MASKED_LOGIT
            lsm = torch.log_softmax(z / args.temperature, -1)
            logp, ent = lsm.gather(1, targets[:, None]).squeeze(1), -(lsm.exp() * lsm).sum(-1)
        else:
            logp, ent = _run(variant, h, w, targets, args.temperature, args.chunk)
        ((a.to(dtype) * logp).sum() + (b.to(dtype) * ent).sum()).backward()
        return {"logp": logp, "ent": ent, "grad_hidden": h.grad, "grad_weight": w.grad}

    ref = grads("plain", torch.float64)
    out = {}
    for v in VARIANTS:
        got = grads(v, getattr(torch, args.dtype))
        out[v] = {
            k: (got[k].double() - ref[k]).abs().max().item() / max(1.0, ref[k].abs().max().item())
            for k in ref
        }
    return out


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _summary(runs: list[dict], key: str) -> dict | None:
    vals = [r[key] for r in runs if key in r]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def _size_summary(runs: dict, n: int, vocab: int) -> dict:
    """Median and spread of peak and time per variant at N = ``n``; where the plain one did not fit, the
    least it needed (the cap less its starting data segment, the smallest over the repeats); the
    chunked/plain ratio of the medians (an upper bound where the plain one did not fit); the plain peak
    in [N, V] float32 buffers."""
    out: dict = {v: {k: _summary(runs[f"{v} N={n}"], k) for k in ("peak_mb", "wall_s")} for v in VARIANTS}
    needs = [r["needs_more_than_mb"] for r in runs[f"plain N={n}"] if "needs_more_than_mb" in r]
    pm, cm = out["plain"]["peak_mb"], out["chunked"]["peak_mb"]
    if needs:
        out["plain"]["needs_more_than_mb"] = min(needs)
    plain_mb = pm["median"] if pm else min(needs) if needs else None
    out["ratio"] = cm["median"] / plain_mb if cm and plain_mb else None
    out["ratio_is_upper_bound"] = pm is None
    if pm:
        out["plain"]["nv_fp32_buffers"] = pm["median"] * 2**20 / (n * vocab * 4)
    return out


def _table_row(n: int, s: dict) -> str:
    def cell(x: dict | None, fmt: str = ".0f") -> str:
        return f"{x['median']:{fmt}} ({x['min']:{fmt}}–{x['max']:{fmt}})" if x else "did not fit"

    pm = s["plain"]["peak_mb"]
    plain = cell(pm) if pm else f"> {s['plain'].get('needs_more_than_mb', float('nan')):.0f} (did not fit)"
    ratio = "-" if s["ratio"] is None else f"{'< ' if s['ratio_is_upper_bound'] else ''}{s['ratio']:.3f}"
    return (
        f"| {n} | {plain} | {cell(s['chunked']['peak_mb'])} | {ratio} | "
        f"{cell(s['plain']['wall_s'], '.2f')} | {cell(s['chunked']['wall_s'], '.2f')} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="2048,4096,8192", help="comma-separated N")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cap-gb", type=float, default=None, help="memory cap per process")
    ap.add_argument("--accuracy-tokens", type=int, default=256, help="rows of the float64 comparison")
    ap.add_argument("--out", default="benchmarks/results/logprobs_memory.json")
    ap.add_argument("--worker", choices=["plain", "chunked"], help=argparse.SUPPRESS)
    ap.add_argument("--tokens-one", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--save", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.tokens = args.tokens_one
        return worker(args)
    if args.cap_gb is None:
        avail = next(
            ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemAvailable")
        )
        args.cap_gb = round(int(avail.split()[1]) / 2**20 - 1.5, 1)
    sizes = [int(n) for n in args.tokens.split(",")]
    result: dict = {
        "machine": f"{_cpu()}, {os.cpu_count()} cpus, Python {platform.python_version()}",
        "date": date.today().isoformat(),
        "load_before": os.getloadavg(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "tokens_one", "save")},
        "runs": {},
    }
    tmp = Path(tempfile.mkdtemp(prefix="logprobs_memory_"))
    saved: dict[int, dict[str, str]] = {}
    for rep in range(args.repeats):  # interleaved: drift and load hit every variant alike
        for n in sizes:
            for variant in VARIANTS:
                save = str(tmp / f"{variant}_{n}.pt") if rep == 0 else None
                r = _spawn(variant, n, args, save)
                r["load"] = os.getloadavg()[0]
                result["runs"].setdefault(f"{variant} N={n}", []).append(r)
                if save and "error" not in r:
                    saved.setdefault(n, {})[variant] = save
                print(f"repeat {rep} {variant} N={n}: {r}", flush=True)
    both = [n for n in sizes if len(saved.get(n, {})) == 2]
    if both:
        result["diffs_at_tokens"] = max(both)
        result["diffs"] = _diffs(saved[max(both)]["plain"], saved[max(both)]["chunked"])
    result["error_vs_float64"] = {"tokens": args.accuracy_tokens, **_accuracy(args, args.accuracy_tokens)}
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()
    result["load_after"] = os.getloadavg()
    print(f"# {result['machine']}; load {result['load_before']} -> {result['load_after']}")
    print(f"# V={args.vocab}, H={args.hidden}, {args.dtype}, chunk {args.chunk}, cap {args.cap_gb} GB")
    print("| N | plain peak MB | chunked peak MB | chunked/plain | plain s | chunked s |")
    print("| --- | --- | --- | --- | --- | --- |")
    summary = {n: _size_summary(result["runs"], n, args.vocab) for n in sizes}
    for n, s in summary.items():
        print(_table_row(n, s))
    result["summary"] = summary
    if "diffs" in result:
        print(f"# max abs diff at N={result['diffs_at_tokens']}: {json.dumps(result['diffs'])}")
    print(f"# error against float64 over the largest magnitude: {json.dumps(result['error_vs_float64'])}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
