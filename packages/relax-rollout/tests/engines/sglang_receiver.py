"""SGLang 0.5.23's own receiving side of ``/update_weights_from_tensor``, run outside its server: what its
TP worker does with entry ``tp_rank`` of ``serialized_named_tensors`` (``monkey_patch_torch_reductions()``,
then ``MultiprocessingSerializer.deserialize``, whose ``SafeUnpickler`` admits only allow-listed globals).

The code is SGLang's, read from its installed files (the ``.venv-sglang`` site-packages, or the folder
``RELAX_SGLANG_SRC`` names): ``patch_torch.py`` is loaded whole; from ``common.py``, whose imports pull in
the whole server, the three definitions the path uses are taken out and run. Replaced are only what they
look up around them: ``pybase64`` (the standard ``base64``: same ``b64decode(data, validate=True)``) and
the platform probes ``is_npu`` / ``is_musa`` (False: a CUDA machine). A plain top-level module, so a spawned
child process can import it."""

from __future__ import annotations

import ast
import base64
import importlib.util
import io
import os
import pickle
import sys
import types
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch

COMMON = ("SafeUnpickler", "MultiprocessingSerializer", "_safe_load_torch_storage")


def sglang_site() -> Path | None:
    """The folder holding the ``sglang`` package, or None where it is not installed."""
    named = os.environ.get("RELAX_SGLANG_SRC")
    candidates = (
        [Path(named)]
        if named
        else sorted(Path(__file__).parents[4].glob(".venv-sglang/lib/python3*/site-packages"))
    )
    for site in candidates:
        if (site / "sglang" / "srt" / "utils" / "patch_torch.py").is_file():
            return site
    return None


def load(site: Path) -> tuple[types.ModuleType, types.ModuleType]:
    """(patch_torch, common) as modules named as in SGLang, so the unpickler's allow-list finds them."""
    utils = site / "sglang" / "srt" / "utils"
    for pkg in ("sglang", "sglang.srt", "sglang.srt.utils"):
        sys.modules.setdefault(pkg, types.ModuleType(pkg))
    common = types.ModuleType("sglang.srt.utils.common")
    common.__dict__.update(
        io=io,
        pickle=pickle,
        torch=torch,
        ForkingPickler=ForkingPickler,
        pybase64=base64,
        is_npu=lambda: False,
        is_musa=lambda: False,
        torch_release=tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:3]),
    )
    path = utils / "common.py"
    tree = ast.parse(path.read_text())
    body = [node for node in tree.body if getattr(node, "name", None) in COMMON]
    missing = set(COMMON) - {node.name for node in body}
    if missing:
        raise RuntimeError(
            f"{path} no longer defines {sorted(missing)}: this SGLang is not the pinned 0.5.23"
        )
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), common.__dict__)
    sys.modules["sglang.srt.utils.common"] = common
    spec = importlib.util.spec_from_file_location("sglang.srt.utils.patch_torch", utils / "patch_torch.py")
    patch = importlib.util.module_from_spec(spec)
    sys.modules["sglang.srt.utils.patch_torch"] = patch
    spec.loader.exec_module(patch)
    return patch, common


def receive_main(site: str, payload: str, queue) -> None:
    """Deserialize one TP rank's entry as SGLang does; report each tensor's name, device, dtype and a
    checksum of its bytes (or the error)."""
    try:
        patch, common = load(Path(site))
        patch.monkey_patch_torch_reductions()
        named = common.MultiprocessingSerializer.deserialize(payload)
        from relax_core.dcs import checksum

        queue.put(
            {
                "checksum": checksum(named),
                "devices": sorted({str(t.device) for _, t in named}),
                "names": [n for n, _ in named],
            }
        )
    except Exception as e:  # noqa: BLE001 - reported to the test, which fails with it
        queue.put({"error": f"{type(e).__name__}: {e}"})
