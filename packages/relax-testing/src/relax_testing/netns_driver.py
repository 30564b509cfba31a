"""A run's driver on a namespace node (#40): ``python -m relax_testing.netns_driver RESULT.json FLAGS...``
runs ``relax train FLAGS...`` (the same config and Controller) and writes what a test checks to RESULT.json:
the history, the eval curve, the trained prompts and ids, the health events and where each role ran.

Why a module and not ``relax train``: the test started in the root namespace reads the run's audit (which
prompts were trained, on which node each role was), which the command line does not print. Started inside
the head's namespace with :meth:`relax_testing.netns.Node.exec_argv`.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    from relax_core.cli_config import build_config
    from relax_core.controller import Controller, RunInputs

    out, flags = argv[0], argv[1:]
    cfg = build_config(None, flags)
    inputs = RunInputs(cfg.model.hf_checkpoint, cfg.data.prompt_data, cfg.data.eval_data)
    result = Controller(cfg, inputs).run()
    keep = ("trained_prompts", "trained_ids", "health", "placement")
    record = {
        "history": result.history,
        "eval_curve": result.eval_curve,
        "wall_s": result.wall_s,
        "audit": {k: result.audit.get(k) for k in keep},
    }
    with open(out, "w") as f:
        json.dump(record, f, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
