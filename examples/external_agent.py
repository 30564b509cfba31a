"""An agent Relax trains without owning it: plain OpenAI client code, pointed at Relax's rollout server.

Relax records every call of a session (the ``X-Relax-Session`` header) as trajectory tokens with loss masks;
closing the session with a reward makes it a training sample. Start a server first, e.g.
``python -m relax_rollout.server --model DIR --port 30000``, then
``python examples/external_agent.py --base-url http://127.0.0.1:30000/v1 --session calc-1 --question 12*7``.
The model may ask for arithmetic by writing ``calc: <expr>``; the agent answers with the result.
"""

import argparse
import ast
import json
import operator
import re
import urllib.request
from urllib.parse import quote

import openai

SYSTEM = "Solve the problem. To compute, write `calc: <expression>` and wait for the result."
CALC = re.compile(r"calc:\s*([-+*/().0-9 ]+)")
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calc(expr: str) -> float:
    """Numbers and + - * / only (no eval: the expression comes from a model)."""

    def ev(n: ast.AST) -> float:
        if isinstance(n, ast.Constant) and type(n.value) in (int, float):
            return n.value
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            return -ev(n.operand)
        if isinstance(n, ast.BinOp) and type(n.op) in OPS:
            return OPS[type(n.op)](ev(n.left), ev(n.right))
        raise ValueError(f"only numbers and + - * / are allowed, not {type(n).__name__}")

    if len(expr) > 100:
        raise ValueError("expression longer than 100 characters")
    return ev(ast.parse(expr.strip(), mode="eval").body)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", required=True, help="the server's OpenAI base URL, ending in /v1")
    ap.add_argument("--session", required=True, help="names the trajectory Relax records")
    ap.add_argument("--question", default="12*7", help="an arithmetic problem; the reward checks its value")
    ap.add_argument("--api-key", default="none", help="the server's --token when it has one")
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"What is {args.question}?"},
    ]
    for _ in range(args.max_turns):
        r = client.chat.completions.create(
            model="default",
            messages=messages,
            max_tokens=args.max_tokens,
            temperature=1.0,
            extra_headers={"X-Relax-Session": args.session},
        )
        reply = r.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": reply})  # resend it verbatim: Relax matches history
        m = CALC.search(reply)
        if m is None:
            break
        try:
            result = f"result: {calc(m.group(1))}"
        except (ValueError, SyntaxError, ZeroDivisionError) as e:
            result = f"error: {e}"
        messages.append({"role": "user", "content": result})
    final = [m["content"] for m in messages if m["role"] == "assistant"][-1]
    reward = float(f"{calc(args.question):g}" in final)
    url = f"{args.base_url.removesuffix('/v1')}/relax/trajectories/{quote(args.session, safe='')}/close"
    req = urllib.request.Request(
        url,
        data=json.dumps({"reward": reward}).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {args.api_key}"},
    )
    with urllib.request.urlopen(req) as resp:
        summary = json.load(resp)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
