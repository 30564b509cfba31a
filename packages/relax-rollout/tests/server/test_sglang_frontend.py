"""SGLang 0.5.23's frontend language (``sgl.function``, ``gen``, ``select``, ``fork``, chat roles, streaming,
``run_batch``) on ``sgl.RuntimeEndpoint``, unmodified, against our engine server (#25). Every call failed
before: ``gen`` on the ``stop_regex: []`` it sends, ``select`` and ``fork`` on ``max_new_tokens: 0``, and
``select`` needs ``logprob_start_len``'s ``input_token_logprobs``. (One process runs them all, to import
SGLang once; the frontend turns a failed request into ``state.error()``, which the driver reports.)"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

pytestmark = [pytest.mark.real_sglang, pytest.mark.integration]

PREFIX, CHOICES = "1+2=", ["3", "4", "abc"]
DRIVER = """
import json, os, sys, threading
import sglang as sgl

url, stop, prefix, choices = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
sgl.set_default_backend(sgl.RuntimeEndpoint(url))

@sgl.function
def gen(s):
    s += prefix + sgl.gen("a", max_tokens=6, stop=stop, temperature=0)

@sgl.function
def sampled(s):
    s += prefix + sgl.gen("a", max_tokens=4, temperature=0.7, top_p=0.9, ignore_eos=True)

@sgl.function
def select(s):
    s += prefix + sgl.select("a", choices=choices)

@sgl.function
def forked(s):
    s += prefix + sgl.gen("a", max_tokens=2, temperature=0)
    branches = s.fork(2)
    for i, b in enumerate(branches):
        b += str(i) + sgl.gen("b", max_tokens=2, temperature=0)
    branches.join()
    s += sgl.select("c", choices=["A", "B"])

@sgl.function
def chat(s):
    s += sgl.user("1+2")
    s += sgl.assistant(sgl.gen("a", max_tokens=3, temperature=0))
    s += sgl.user("ok")
    s += sgl.assistant(sgl.select("b", choices=["yes", "no"]))

def streamed():
    st = gen.run(stream=True)
    st.joined = "".join(st.text_iter("a"))
    return st

out = {}
def run(name, make, read):
    # one program, its failure reported (the frontend keeps a failed request in state.error(); a fork
    # after one waits forever: hence the thread)
    box = {}
    def go():
        try:
            made = make()
            sts = made if isinstance(made, list) else [made]
            errors = [repr(st.error()) for st in sts if st.error() is not None]
            box["out"] = {"error": errors[0]} if errors else {"value": read(sts)}
        except Exception as e:
            box["out"] = {"error": repr(e)}
    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(60)
    out[name] = box.get("out", {"error": "no answer in 60 s"})

run("gen", gen.run, lambda s: s[0]["a"])
run("sampled", sampled.run, lambda s: [s[0]["a"], s[0].get_meta_info("a")["completion_tokens"]])
run("select", select.run, lambda s: [s[0]["a"], s[0].get_meta_info("a")["normalized_prompt_logprobs"]])
run("forked", forked.run, lambda s: [s[0]["a"], s[0]["c"]])
run("chat", chat.run, lambda s: [s[0]["a"], s[0]["b"], s[0].text()])
run("batch", lambda: gen.run_batch([{}, {}]), lambda s: [x["a"] for x in s])
run("stream", streamed, lambda s: s[0].joined)
print("RESULT " + json.dumps(out), flush=True)
os._exit(0)
"""


def _normalized_prompt_logprobs(tiny_model_dir: str) -> list[float]:
    """What the frontend's ``select`` scores each choice with, from the model itself: the mean log-prob of
    the prompt's last token and the choice's tokens (it asks from two tokens before the choice, and SGLang
    lists the first of those without a log-prob)."""
    import torch
    from transformers import AutoTokenizer

    from relax_core.models import load_model

    tok, model = AutoTokenizer.from_pretrained(tiny_model_dir), load_model(tiny_model_dir, "float32").eval()
    first = len(tok.encode(PREFIX, add_special_tokens=False)) - 1
    scores = []
    for c in CHOICES:
        ids = tok.encode(PREFIX + c, add_special_tokens=False)
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
        scores.append(
            lp.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)[first - 1 :].mean().item()
        )
    return scores


def test_the_sglang_frontend_runs_against_our_server(
    engine_server, tiny_model_dir, sglang_python, call, tmp_path
):
    sp = {"max_new_tokens": 6, "temperature": 0}
    code, free = call(engine_server, "/generate", {"text": PREFIX, "sampling_params": sp})
    assert code == 200, free
    assert len(free["text"]) == 6, free
    stop = free["text"][2]  # (one character: one token here); the greedy text is cut before its first match
    want = free["text"][: free["text"].index(stop)]
    r = subprocess.run(
        [sglang_python, "-c", DRIVER, engine_server, stop, PREFIX, json.dumps(CHOICES)],
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        cwd=tmp_path,
    )
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, (r.stdout + r.stderr)[-3000:]
    res = json.loads(lines[0].removeprefix("RESULT "))
    assert {k: v["error"] for k, v in res.items() if "error" in v} == {}, res
    out = {k: v["value"] for k, v in res.items()}
    assert out["gen"] == want and out["batch"] == [want, want] and out["stream"] == want
    # (a sampled <|im_end|> decodes to nothing: CI once drew it first, so the text alone may be empty)
    sampled, made = out["sampled"]
    assert isinstance(sampled, str) and len(sampled) <= 4 and made == 4
    scores = _normalized_prompt_logprobs(tiny_model_dir)
    choice, seen = out["select"]
    assert seen == pytest.approx(scores, abs=1e-4) and choice == CHOICES[scores.index(max(scores))]
    (forked, picked), (answer, yes_no, text) = out["forked"], out["chat"]
    assert isinstance(forked, str) and picked in ("A", "B") and isinstance(answer, str)
    assert yes_no in ("yes", "no") and text.index("1+2") < text.rindex(yes_no)  # (the roles' text)
