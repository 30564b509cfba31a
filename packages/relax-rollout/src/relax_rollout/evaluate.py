"""Held-out greedy evaluation with the torch engine on a given model (the trainer's, in place)."""

from __future__ import annotations

from relax_core.config import RelaxConfig
from relax_core.data import load_prompts
from relax_rollout.engines import SamplingParams
from relax_rollout.engines.torch_engine import TorchEngine
from relax_rollout.prompts import render
from relax_rollout.rewards import build_scorer


class GreedyEvaluator:
    def __init__(self, cfg: RelaxConfig, tokenizer_path: str, eval_path: str) -> None:
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        rows = load_prompts(eval_path, cfg.data.input_key, cfg.data.label_key, cfg.data.metadata_key).rows
        self.rows = rows[: cfg.data.eval_max_samples]
        # the prompts as training renders them (the chat template of messages, --apply-chat-template)
        texts = [render(self.tokenizer, r.prompt, cfg.data.apply_chat_template) for r in self.rows]
        self.prompts = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        r = cfg.rollout  # held-out accuracy is the task's reward (--eval-rm-type), with no emulated latency
        upd = {"reward_delay_s": 0.0, "rm_type": r.eval_rm_type or r.rm_type}
        self.scorer = build_scorer(cfg.model_copy(update={"rollout": r.model_copy(update=upd)}))

    def __call__(self, model) -> float:
        was_training = model.training
        engine = TorchEngine(
            model=model,
            eos_token_ids=[self.tokenizer.eos_token_id],
            pad_token_id=self.tokenizer.pad_token_id,
            tokenizer=self.tokenizer,  # (decodes for --rollout-stop's strings)
        )
        r = self.cfg.rollout  # answers end where training's do: the same stop strings and token ids
        params = SamplingParams(
            max_new_tokens=r.rollout_max_response_len,
            greedy=True,
            stop=tuple(r.rollout_stop),
            stop_token_ids=tuple(r.rollout_stop_token_ids),
        )
        outs = engine.generate(self.prompts, params)
        texts = [self.tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outs]
        res = self.scorer.score_batch(texts, [r.label for r in self.rows], [r.metadata for r in self.rows])
        model.train(was_training)
        return float(sum(x.score > 0 for x in res)) / max(len(res), 1)
