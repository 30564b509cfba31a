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


def test_every_builtin_reward_module_imports_without_heavy_deps():
    code = (
        "import sys, relax_rewards\n"
        "names = relax_rewards.list_rewards()\n"
        "import relax_rewards.isolation, relax_rewards.group\n"
        "print(sorted(m for m in ('torch', 'ray', 'sympy', 'httpx', 'requests') if m in sys.modules), len(names))"
    )
    heavy, count = _run(code).split(" ")[0:-1], _run(code).split(" ")[-1]
    assert " ".join(heavy) == "[]" and int(count) >= 12
