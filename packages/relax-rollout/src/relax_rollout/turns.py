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
    tokenizer: Any,
    history: list[dict[str, Any]],
    new_messages: list[dict[str, Any]],
    model_ended: bool,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids the chat template puts after the last assistant turn of ``history`` for ``new_messages``
    and the next generation prompt (:func:`turn_suffix_text`, tokenised on its own)."""
    text = turn_suffix_text(tokenizer, history, new_messages, model_ended, template_kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def turn_suffix_text(
    tokenizer: Any,
    history: list[dict[str, Any]],
    new_messages: list[dict[str, Any]],
    model_ended: bool,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The text the chat template puts after the last assistant turn of ``history`` for ``new_messages``
    and the next generation prompt (multimodal observations expand its media markers before tokenising).

    ``history`` ends with the assistant turn the model just produced (its text is not used: a marker stands
    in for it to locate the template's boundary). ``model_ended``: the model's tokens already end with the
    end-of-turn token (its EOS); otherwise (cut by a length limit) the end-of-turn token is in the suffix.
    ``template_kwargs``: more arguments of the chat template, the same the conversation was rendered with
    (``tools``, ``enable_thinking``, ...).
    """
    eos = tokenizer.eos_token
    # the reply's own text is replaced by a marker: an empty reply, a reply that is a piece of the template
    # ("d" of "<|im_end|>"), or one the template rewrites (think blocks) would hide the turn's end
    marked = [*history[:-1], {**history[-1], "content": _MARK}]
    kwargs = template_kwargs or {}
    before = tokenizer.apply_chat_template(marked, tokenize=False, **kwargs)
    after = tokenizer.apply_chat_template(
        marked + new_messages, tokenize=False, add_generation_prompt=True, **kwargs
    )
    if not after.startswith(before):
        raise ValueError(
            "the chat template is not append-only for these messages (rendering more turns changed earlier "
            "text), so a conversation cannot be extended token by token; use a template without history edits"
        )
    at = before.rfind(_MARK)
    cut = before.find(eos, at + len(_MARK)) if eos and at >= 0 else -1
    if cut < 0:
        raise ValueError(
            f"cannot find the end-of-turn token {eos!r} after the last assistant turn in the template"
        )
    if model_ended:
        cut += len(eos)
    return after[cut:]


_MARK = "\u2063relax-turn\u2063"
