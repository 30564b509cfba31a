#!/usr/bin/env bash
# Gathers what the GPU checks need on a lent GPU machine that cannot reach a registry: Python 3.12 wheels
# of the packages its image lacks (.whl/) and SGLang's receiving files for the tensor-update check (.gpu/),
# both ignored by git (.git/info/exclude) and carried with the run. Then run.sh runs there.
set -euo pipefail
cd "$(dirname "$0")/../.."
for d in /.whl/ /.gpu/; do grep -qx "$d" .git/info/exclude 2>/dev/null || echo "$d" >>.git/info/exclude; done
rm -rf .whl && mkdir -p .whl
# (the image has torch, transformers, numpy, pyyaml, psutil, sympy, safetensors, pytest: see KINDS.md)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  -d .whl pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
  megatron-core==0.16.1 peft==0.21.2
site=$(ls -d .venv-sglang/lib/python3*/site-packages)  # bash tools/sglang-cpu/setup.sh made it
rm -rf .gpu && mkdir -p .gpu/sglang/sglang/srt/utils
cp "$site"/sglang/srt/utils/{common,patch_torch}.py .gpu/sglang/sglang/srt/utils/
du -sh .whl .gpu
