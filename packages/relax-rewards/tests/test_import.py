"""``import relax_rewards`` must stay light: no torch, no Ray, and no sympy until a math comparison."""

import subprocess
import sys


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_import_is_light():
    code = (
        "import sys, relax_rewards\nprint(sorted(m for m in ('torch', 'ray', 'sympy') if m in sys.modules))"
    )
    assert _run(code) == "[]"


def test_registry_lookup_and_string_match_do_not_need_sympy():
    code = (
        "import sys, relax_rewards\n"
        "r = relax_rewards.get_reward('math')(r'\\\\boxed{42}', '42')\n"
        "print(r.score, 'sympy' in sys.modules, 'torch' in sys.modules, 'ray' in sys.modules)"
    )
    assert _run(code) == "1.0 False False False"
