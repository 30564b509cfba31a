"""The code reward and its sandbox: tests pass/fail, limits, no network, no escape."""

import socket
import time

import pytest

from relax_rewards.code import code_reward, extract_code, parse_tests
from relax_rewards.sandbox import network_namespace_available, run_python

DOUBLE = "```python\nprint(int(input()) * 2)\n```"


def test_stdin_stdout_cases_give_fraction_passed():
    label = {"inputs": ["1", "2", "3"], "outputs": ["2", "4", "7"]}
    r = code_reward(DOUBLE, label)
    assert r.score == pytest.approx(2 / 3) and r.details["passed"] == 2
    assert code_reward(DOUBLE, label, {"all_or_nothing": True}).score == 0.0


def test_assert_style_tests():
    code = "```python\ndef add(a, b):\n    return a + b\n```"
    assert code_reward(code, ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]).score == 1.0
    assert code_reward(code, "assert add(1, 2) == 4").score == 0.0


def test_json_label_and_list_of_dicts():
    assert parse_tests('{"inputs": ["1"], "outputs": ["2"]}') == ([("1", "2")], None)
    assert code_reward(DOUBLE, [{"input": "5\n", "output": "10\n"}]).score == 1.0


def test_no_code_and_syntax_error():
    assert code_reward("", [{"input": "", "output": ""}]).score == 0.0
    assert (
        code_reward("```python\ndef (:\n```", "assert True").details["first_error"].startswith("SyntaxError")
    )


def test_extract_code_prefers_last_python_block():
    text = "```python\nprint(1)\n```\n```text\nout\n```\n```python\nprint(2)\n```"
    assert extract_code(text) == "print(2)\n"


def test_time_limit_kills_infinite_loop():
    start = time.monotonic()
    r = code_reward("```python\nwhile True: pass\n```", "assert True", {"timeout_s": 0.5})
    assert r.score == 0.0 and r.details["first_error"] == "timeout"
    assert time.monotonic() - start < 0.5 * 1.1 + 0.5


def test_memory_limit():
    r = run_python("x = bytearray(2 * 1024**3)\nprint('allocated')", memory_mb=256)
    assert r.returncode != 0 and "allocated" not in r.stdout and "MemoryError" in r.stderr


@pytest.mark.parametrize(
    "code,blocked",
    [
        ("import socket; socket.socket()", "socket"),
        ("import socket; socket.create_connection(('127.0.0.1', {port}))", "socket"),
        ("import os; os.system('echo hi')", "os.system"),
        ("import subprocess; subprocess.run(['true'])", "subprocess"),
        ("import os; os.fork()", "os.fork"),
        ("import ctypes; ctypes.CDLL(None)", "ctypes"),
    ],
)
def test_no_network_no_processes(code, blocked):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    try:
        r = run_python(code.format(port=server.getsockname()[1]))
    finally:
        server.close()
    assert r.returncode != 0 and "PermissionError" in r.stderr and blocked in r.stderr


def test_network_namespace_has_no_interfaces_when_available():
    if not network_namespace_available():
        pytest.skip("unshare -rn not permitted here; the audit hook alone blocks sockets")
    code = "print(open('/proc/net/dev').read().count(':'))"  # interfaces in this namespace
    assert run_python(code).stdout.strip() == "1"  # loopback only (and it is down)


def test_clean_env_and_temp_cwd(monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "xyz")
    out = run_python("import os; print(os.getcwd()); print(sorted(os.environ))").stdout
    cwd, env = out.splitlines()
    assert "relax-sandbox-" in cwd and "SECRET_TOKEN" not in env
    assert run_python(f"import os; print(os.path.exists({cwd!r}))").stdout.strip() == "False"
