#!/usr/bin/env bash
# Builds .venv-sglang: the real SGLang server (the version uv.lock pins) runnable on this CPU, for the
# real-SGLang test tier (`uv run pytest -m real_sglang`) and benchmarks/sglang_weight_update.py.
#
# Why a venv of its own: SGLang's wheel requires CUDA-only packages (flashinfer, flash-attn, DeepEP,
# DeepGEMM, FlashMLA, CUTLASS DSL, NVSHMEM, TileLang, sglang-kernel) that are not needed with
# `--device cpu`. So: every package of the lock's `relax-rollout[sglang]` resolution, at the lock's
# versions, installed with --no-deps, minus those; then our import shim `sgl_kernel` (shim/, see its
# docstring). Everything comes from the package registry; nothing is downloaded otherwise.
#
# Usage: bash tools/sglang-cpu/setup.sh [VENV_DIR]    (default: .venv-sglang at the repo root)
# The tests find it at .venv-sglang or at $RELAX_SGLANG_PYTHON (its python).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${1:-$root/.venv-sglang}"
command -v uv >/dev/null 2>&1 || python3 -m pip install --quiet uv

# CUDA-only: kernels and communication libraries SGLang's CPU path never calls
exclude='^(flashinfer-python|flashinfer-cubin|flash-attn-4|sgl-deep-ep|sgl-deep-gemm|sgl-flash-mla|sglang-kernel|tilelang|nvshmem4py-cu13|nvidia-cutlass-dsl.*|humming-kernels|quack-kernels|cuda-tile|deepseek-recipe|torch-memory-saver|nccl4py|nccl-extensions)=='

reqs="$(mktemp)"
trap 'rm -f "$reqs"' EXIT
(cd "$root" && uv export --frozen --package relax-rollout --extra sglang --no-emit-workspace --no-hashes \
  --no-header --no-annotate) | grep -Ev "$exclude" > "$reqs"
grep -q '^sglang==' "$reqs" || { echo "uv.lock has no sglang pin: add the relax-rollout[sglang] extra" >&2; exit 1; }

[ -x "$venv/bin/python" ] || uv venv --quiet --python 3.11 "$venv"
uv pip install --quiet --python "$venv/bin/python" --no-deps -r "$reqs"
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
rm -rf "$site/sgl_kernel"
cp -r "$here/shim/sgl_kernel" "$site/sgl_kernel"
"$venv/bin/python" -c 'import sglang, sglang.launch_server; print("sglang", sglang.__version__, "ready for --device cpu")'
