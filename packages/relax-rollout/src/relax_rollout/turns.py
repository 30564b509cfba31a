"""Token-exact multi-turn conversations: what to append after a model turn, never re-tokenising history.

Why: re-rendering the whole conversation through the chat template and tokenising it again at every turn
silently changes the model's own tokens (a sampled BPE split is often not the canonical one; slime #2263
found 77 of 200 real trajectories tokenised wrongly), and then the trainer computes log-probs of tokens
the model never produced. Instead a trajectory is built token in / token out: the model's tokens exactly
as generated, then only the *new* part of the template — the end of the assistant turn, the new user /
tool turns and the next generation prompt — tokenised on its own. Where the template is deterministic and
the model's tokens are canonical, the result equals the template's rendering of the whole conversation
(tested).
"""

from __future__ import annotations

from typing import Any


def turn_suffix_ids(
    tokenizer: Any, history: list[dict[str, Any]], new_messages: list[dict[str, Any]], model_ended: bool
) -> list[int]:
    """Token ids the chat template puts after the last assistant turn of ``history`` for ``new_messages``
    and the next generation prompt.

    ``history`` ends with the assistant turn the model just produced (its text is only used to locate the
    template's boundary). ``model_ended``: the model's tokens already end with the end-of-turn token (its
    EOS); otherwise (cut by a length limit) the end-of-turn token is part of the suffix.
    """
    eos = tokenizer.eos_token
    before = tokenizer.apply_chat_template(history, tokenize=False)
    after = tokenizer.apply_chat_template(history + new_messages, tokenize=False, add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError(
            "the chat template is not append-only for these messages (rendering more turns changed earlier "
            "text), so a conversation cannot be extended token by token; use a template without history edits"
        )
    content = history[-1].get("content") or ""
    end = before.rfind(content) + len(content) if content else -1
    cut = before.find(eos, end) if eos and end >= 0 else -1
    if cut < 0:
        raise ValueError(
            f"cannot find the end-of-turn token {eos!r} after the last assistant turn in the template"
        )
    if model_ended:
        cut += len(eos)
    return tokenizer(after[cut:], add_special_tokens=False)["input_ids"]
