"""The lm-evaluation-harness model "llm_jax": any checkpoint `load_pretrained` reads, scored with
llm_jax/inference/scoring.py and generating with the continuous-batching engine
(llm_jax/inference/engine.py, driven by llm_jax/inference/completions.py). Needs the `eval`
extra (`pip install -e ".[eval]"`).

    python -m llm_jax.eval --model llm_jax --model_args checkpoint=DIR,max_length=2048 \
        --tasks hellaswag --output_path results/

model_args: checkpoint (required), dtype, max_length (positions per forward pass; default
2048), batch_size (rows per scoring call; lm_eval's --batch_size), pack (several short requests
per row), max_gen_toks (default new tokens for generate_until; 256), slots (sequences decoded
together; 16), reasoning_effort (low, medium or high: the chat template's, for a checkpoint that
speaks harmony).

On a harmony checkpoint (gpt-oss) a generation whose prompt opens an assistant message (ends in
`<|start|>assistant`, as `--apply_chat_template` renders it) is parsed, and its answer is the
final channel's text (`harmony.final_text`): no reasoning, no framing tokens, "" when the model
never reached it (a tool call, or the length limit). The task's `until` strings then cut that
answer, not the reasoning before it. Any other prompt's generation is its text, as for any
checkpoint.
"""

from __future__ import annotations

from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from llm_jax.data import harmony
from llm_jax.inference.completions import GenerationRequest, engine_for, generate_until
from llm_jax.inference.scoring import loglikelihood, loglikelihood_rolling
from llm_jax.inference.tokenizer import load_tokenizer
from llm_jax.weights.readers import load_pretrained


def _flag(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


@register_model("llm_jax")
class LlmJaxLM(TemplateLM):
    """lm_eval's three requests (loglikelihood, loglikelihood_rolling, generate_until) over one
    llm_jax checkpoint."""

    def __init__(self, checkpoint: str, dtype: str | None = None, max_length: int = 2048,
                 batch_size: int | str = 8, pack: bool | str = False, max_gen_toks: int = 256,
                 slots: int = 16, reasoning_effort: str | None = None, **unused: Any):
        super().__init__()
        if reasoning_effort is not None and reasoning_effort not in harmony.REASONING_EFFORTS:
            raise ValueError(f"model_args reasoning_effort={reasoning_effort!r} is invalid: "
                             f"expected one of {harmony.REASONING_EFFORTS}")
        self.model = load_pretrained(checkpoint, dtype=dtype)
        self.text = load_tokenizer(checkpoint)
        if self.text is None:
            raise ValueError(f"{checkpoint} has no tokenizer (tokenizer.json or tokenizer.model): "
                             f"lm_eval works on text")
        if self.text.eos_id is None:
            raise ValueError(f"the tokenizer of {checkpoint} has no EOS token: lm_eval needs one "
                             f"as end-of-text (the context of an empty prompt)")
        self.checkpoint = str(checkpoint)
        self.max_length = int(max_length)
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8  # "auto": 8
        self.pack, self.max_gen_toks, self.slots = _flag(pack), int(max_gen_toks), int(slots)
        self.template_options = ({"reasoning_effort": reasoning_effort}
                                 if reasoning_effort is not None else {})
        # the ids that open an assistant message: a prompt ending in them is answered in harmony
        self.assistant_prompt = (self.text.encode("<|start|>assistant")
                                 if self.text.harmony is not None else None)

    @property
    def eot_token_id(self) -> int:
        return self.text.eos_id

    @property
    def tokenizer_name(self) -> str:
        return f"llm_jax:{self.checkpoint}"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs: Any) -> list[int]:
        return self.text.encode(string)

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        return self.text.render(chat_history, **self.template_options)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        pairs = [(ctx or [self.eot_token_id], cont) for _, ctx, cont in requests]
        scored = [i for i, (_, cont) in enumerate(pairs) if cont]
        scores = loglikelihood(self.model, [pairs[i] for i in scored], max_length=self.max_length,
                               batch_size=self.batch_size, pack=self.pack)
        out = [(0.0, True)] * len(pairs)  # an empty continuation: probability 1
        for i, s in zip(scored, scores):
            out[i] = (s.logprob, s.is_greedy)
        for (key, _, _), answer in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", key, answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        texts = [self.tok_encode(req.args[0]) for req in requests]
        out = loglikelihood_rolling(self.model, texts, self.prefix_token_id,
                                    max_length=self.max_length, batch_size=self.batch_size,
                                    pack=self.pack)
        for req, total in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return out

    def _answers_in_harmony(self, prompt: list[int]) -> bool:
        n = len(self.assistant_prompt or ())
        return n > 0 and prompt[-n:] == self.assistant_prompt

    def final_text(self, tokens: list[int]) -> str:
        """The final channel's text of harmony output `tokens` (what followed
        `<|start|>assistant`)."""
        return harmony.final_text(harmony.parse(self.text.harmony, tokens, self.text.decode))

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        gens, answers, untils = [], [], []
        for req in requests:
            context, kwargs = req.args[0], dict(req.args[1] or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            sampled = _flag(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 0.0)) if sampled else 0.0
            keep = max(1, self.max_length - new)  # the context's last tokens that fit
            prompt = self.tok_encode(context)[-keep:] or [self.eot_token_id]
            answers.append(self._answers_in_harmony(prompt))
            gens.append(GenerationRequest(
                prompt, max_new_tokens=new, temperature=temperature,
                top_p=float(kwargs.pop("top_p", 1.0)) if sampled else 1.0,
                seed=int(kwargs.pop("seed", 0)), stop=() if answers[-1] else until,
                stop_ids=list(self.text.stop_ids)))
            untils.append(until)
        if not gens:
            return []
        engine = engine_for(self.model, gens, self.slots)
        out = [_cut(self.final_text(g.tokens), until) if harmonic else g.text
               for g, harmonic, until in zip(generate_until(engine, gens, self.text.decode),
                                             answers, untils)]
        for req, text in zip(requests, out):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return out


def _cut(text: str, until: list[str]) -> str:
    """`text` up to the first of the `until` strings."""
    return text[:min((i for s in until if s and (i := text.find(s)) >= 0), default=len(text))]
