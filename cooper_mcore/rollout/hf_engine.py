"""A rollout engine on transformers, for CPU runs and small GPUs.

Batched sampling with a KV cache (``model.generate`` on left-padded prompts, positions from the
attention mask, so padding does not change the result), temperature / top-p / max tokens / stop
strings, per-token log-probabilities of the sampled tokens under the model's raw distribution
(temperature 1, as the trainer's old-policy log-probabilities). Weights arrive through the same
``update_weights`` path as SGLang's: buckets of named Hugging Face tensors.

Memory behaves as SGLang's (torch_memory_saver) does, so that a CPU run exercises the trainer's
order of operations as a GPU run would: :meth:`HFEngine.release_memory` with the ``weights`` tag
frees the weights' storage and, without ``weights_cpu_backup``, loses them: after
:meth:`HFEngine.resume_memory` they hold undefined values (NaN here) until every weight has been
pushed again with :meth:`HFEngine.update_weights`. Generating while any memory is released, or with
weights that were lost and not pushed again, raises ``RuntimeError``; so does pushing weights
into released weight memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any, Optional

import torch
import transformers

try:  # transformers 5
    from transformers.initialization import no_init_weights
except ImportError:
    try:  # transformers 4
        from transformers.modeling_utils import no_init_weights
    except ImportError:  # the weights are initialised, then overwritten by the first push: only slower
        no_init_weights = contextlib.nullcontext

from cooper_mcore.data.tokenizer import check_tokenizer_fits, load_tokenizer
from cooper_mcore.rollout.base import GenerateOutput, Prompts, SamplingParams, memory_tags

logger = logging.getLogger(__name__)

#: transformers 5 fuses a mixture-of-experts layer's experts into ``experts.gate_up_proj``
#: ``[experts, 2 * ffn, hidden]`` (gate rows first) and ``experts.down_proj``; the pushed names are
#: the safetensors files' per-expert ones
_EXPERT_PIECE = re.compile(r"^(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


class HFEngine:
    """Rollout engine over a ``transformers`` causal LM.

    Args:
        model: a loaded ``AutoModelForCausalLM`` (its device is the engine's device).
        tokenizer: used for text prompts, decoding and stop strings; optional for token-id
            prompts (then ``text`` is empty and stop strings are not supported).
        eos_token_id / pad_token_id: default: from the tokenizer or the model config.
        max_batch_size: prompts generated together at most.
        weights_cpu_backup: keep a host copy of the weights while they are released (SGLang's
            ``enable_weights_cpu_backup``), so that resuming restores them.
    """

    def __init__(self, model, tokenizer=None, eos_token_id: Optional[int] = None,
                 pad_token_id: Optional[int] = None, max_batch_size: int = 64,
                 weights_cpu_backup: bool = False) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        cfg = model.config
        self.eos_token_id = _first(eos_token_id, getattr(tokenizer, "eos_token_id", None), cfg.eos_token_id)
        self.pad_token_id = _first(pad_token_id, getattr(tokenizer, "pad_token_id", None), cfg.pad_token_id,
                                   self.eos_token_id, 0)
        self.max_batch_size = max_batch_size
        self.weight_version = 0
        self._device = next(model.parameters()).device
        self._params = dict(model.named_parameters())
        self._released: set[str] = set()
        self._stale: set[str] = set()  # weights lost by a release and not pushed since
        self._backup: Optional[dict[str, torch.Tensor]] = None
        self._shapes = {n: p.shape for n, p in self._params.items()}
        self.weights_cpu_backup = weights_cpu_backup

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
                        trust_remote_code: bool = False, **kwargs) -> HFEngine:
        """Load a model (and its tokenizer if the folder has one) from an HF folder.

        Weights are read from safetensors only (a folder with only ``pytorch_model.bin`` pickles is
        refused); ``trust_remote_code`` lets the folder's own Python code run (off unless asked).

        Raises:
            ValueError: the tokenizer has ids past the model's vocabulary (both sizes named).
        """
        tok = None
        if any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model",
                                                                 "tokenizer_config.json")):
            tok = load_tokenizer(path, trust_remote_code=trust_remote_code)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, use_safetensors=True, trust_remote_code=trust_remote_code)
        if tok is not None:
            check_tokenizer_fits(tok, model.get_input_embeddings().num_embeddings, path, tokenizer_path=path)
        return cls(model.to(device), tok, **kwargs)

    @classmethod
    def from_config(cls, hf_config: dict[str, Any], tokenizer=None, dtype: torch.dtype = torch.float32,
                    device: str = "cpu", **kwargs) -> HFEngine:
        """An engine whose model is built from an HF config directly on ``device``, its weights left
        undefined (nothing is read or initialised): like an engine whose released weights were lost,
        it refuses to generate until every weight has been pushed with :meth:`update_weights`.

        Args:
            hf_config: the model's ``config.json`` contents (its ``model_type`` picks the class).
            tokenizer: as for the constructor; must fit the config's vocabulary.
            dtype / device: the model's parameter dtype and device.

        Raises:
            ValueError: the tokenizer has ids past the config's vocabulary (both sizes named).
        """
        config = transformers.AutoConfig.for_model(**hf_config)
        if tokenizer is not None:
            check_tokenizer_fits(tokenizer, config.vocab_size, f"{config.model_type} config")
        with torch.device(device), no_init_weights():
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.tie_weights()  # skipping the initialisation skips tying the output layer to the embedding too
        engine = cls(model, tokenizer, **kwargs)
        engine._stale = set(engine._params)
        return engine

    # -- generation ---------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: Prompts, params: SamplingParams) -> list[GenerateOutput]:
        """Complete each prompt once (outputs in input order)."""
        params.validate()
        if self._released:
            raise RuntimeError(f"HFEngine.generate called while memory is released ({sorted(self._released)}); "
                               "call resume_memory() first")
        if self._stale:
            raise RuntimeError(f"HFEngine.generate: {len(self._stale)} weights were released without a CPU backup "
                               f"and not pushed again (e.g. {sorted(self._stale)[0]!r}); push the weights "
                               "after resuming them")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        ids = [self._encode(p) for p in prompts]
        gen = torch.Generator(device="cpu")
        if params.seed is not None:
            gen.manual_seed(params.seed)
        else:
            gen.seed()
        outputs: list[GenerateOutput] = []
        for i in range(0, len(ids), self.max_batch_size):
            outputs.extend(self._generate_batch(ids[i:i + self.max_batch_size], params, gen))
        return outputs

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids instead")
            return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("empty prompt")
        return ids

    def _generate_batch(self, ids: list[list[int]], params: SamplingParams, gen: torch.Generator):
        width = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for r, x in enumerate(ids):  # left padding
            input_ids[r, width - len(x):] = torch.tensor(x)
            mask[r, width - len(x):] = 1
        greedy = params.temperature == 0
        config = transformers.GenerationConfig(
            max_new_tokens=params.max_new_tokens, do_sample=not greedy,
            temperature=None if greedy else params.temperature,
            top_p=None if greedy or params.top_p >= 1 else params.top_p, top_k=None if greedy else 0,
            eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id,
            return_dict_in_generate=True, output_logits=True,
        )
        criteria = transformers.StoppingCriteriaList(
            [_StopStrings(self.tokenizer, width, params.stop)] if params.stop else [])
        seed = int(torch.randint(0, 2**62, (1,), generator=gen))
        torch.manual_seed(seed)  # model.generate samples from the global generator
        with _RouterCapture(self.model, params.routed_experts, len(ids), width) as routes:
            out = self.model.generate(
                input_ids=input_ids.to(self._device), attention_mask=mask.to(self._device),
                generation_config=config, stopping_criteria=criteria,
            )
        new = out.sequences[:, width:].cpu()
        # the sampled tokens' log-probabilities under the raw logits, one generated position at a
        # time: no [batch, tokens, vocab] stack or fp32 log-softmax copy beside generate's own logits
        steps = out.sequences[:, width:width + len(out.logits)]
        logp = torch.stack([torch.log_softmax(step.float(), dim=-1).gather(-1, steps[:, i, None]).squeeze(-1)
                            for i, step in enumerate(out.logits)], dim=1).cpu()
        results = []
        for r in range(len(ids)):
            toks = new[r].tolist()
            n, finish = len(toks), "length"
            if self.eos_token_id is not None and self.eos_token_id in toks:
                n, finish = toks.index(self.eos_token_id) + 1, "stop"
            toks = toks[:n]
            text = ""
            if self.tokenizer is not None:
                text = self.tokenizer.decode(toks, skip_special_tokens=True)
                hit = _first_stop(text, params.stop)
                if hit is not None:  # keep the tokens up to the one completing the stop string
                    n = next(k for k in range(1, n + 1) if _first_stop(
                        self.tokenizer.decode(toks[:k], skip_special_tokens=True), params.stop) is not None)
                    toks, text, finish = toks[:n], text[:hit], "stop"
            results.append(GenerateOutput(
                token_ids=toks, text=text,
                logprobs=logp[r, :n].tolist() if params.logprobs else None, finish_reason=finish,
                routed_experts=routes.of_row(r, len(ids[r]), n) if params.routed_experts else None,
            ))
        return results

    @torch.no_grad()
    def score(self, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int]) -> list[list[float]]:
        """Log-probabilities of the tokens after each prompt, under the current weights."""
        out = []
        for seq, n in zip(sequences, prompt_lengths):
            ids = torch.tensor([list(seq)], device=self._device)
            logits = self.model(ids).logits.float()[0, :-1]
            logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
            out.append(logp[n - 1:].cpu().tolist())
        return out

    # -- weights and memory -------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> None:
        """Copy named HF tensors into the model, bucket by bucket; then set ``weight_version``.

        Raises:
            ValueError: an unknown name or a shape mismatch (naming the tensor and both shapes).
            RuntimeError: the weight memory is released.
        """
        if "weights" in self._released:
            raise RuntimeError("HFEngine.update_weights called while the weights are released; "
                               "resume_memory(['weights']) first")
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        seen: Counter[str] = Counter()  # pieces pushed per parameter (a fused experts' tensor has several)
        for bucket in buckets:
            for name, tensor in bucket:
                key, target = self._target(name)
                if target is None:
                    if tied and name == "lm_head.weight":
                        continue
                    raise ValueError(f"update_weights: the engine's model has no parameter {name!r}")
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the "
                                     f"engine's model {tuple(target.shape)}")
                target.copy_(tensor.to(target.device, non_blocking=True))
                seen[key] += 1
                if seen[key] == self._pieces(key):
                    self._stale.discard(key)
        missing = [n for n in self._params if seen[n] < self._pieces(n)]
        if missing:
            logger.warning("weight update v%d left %d parameters (partly) unchanged, e.g. %s",
                           version, len(missing), sorted(missing)[:3])
        self.weight_version = version

    def _target(self, name: str) -> tuple[str, Optional[torch.Tensor]]:
        """The parameter a pushed tensor fills and the view of it (None: no such parameter)."""
        if name in self._params:
            return name, self._params[name]
        m = _EXPERT_PIECE.match(name)
        if m is None:
            return name, None
        prefix, expert, proj = m.group(1), int(m.group(2)), m.group(3)
        key = f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
        param = self._params.get(key)
        if param is None or param.dim() != 3 or expert >= param.shape[0]:
            return name, None
        if proj == "down_proj":
            return key, param[expert]
        half = param.shape[1] // 2
        return key, param[expert, :half] if proj == "gate_proj" else param[expert, half:]

    def _pieces(self, key: str) -> int:
        """Pushed tensors that fill parameter ``key``: one, or one per expert (two for gate_up_proj)."""
        if not _FUSED_EXPERTS.search(key) or len(self._shapes.get(key, ())) != 3:
            return 1
        return self._shapes[key][0] * (2 if key.endswith("gate_up_proj") else 1)

    @torch.no_grad()
    def release_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        """Free the ``tags`` (all by default); released weights are lost unless ``weights_cpu_backup``.

        The KV cache and CUDA graphs of this engine live only inside a ``generate`` call, so their
        tags only mark the engine as not ready to generate.
        """
        tags = [t for t in memory_tags(tags) if t not in self._released]
        if "weights" in tags:
            if self.weights_cpu_backup:
                self._backup = {n: p.detach().to("cpu", copy=True) for n, p in self._params.items()}
            for p in self._params.values():  # tied weights are one Parameter: freed once
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            if self._device.type == "cuda":
                torch.cuda.empty_cache()
        self._released.update(tags)

    @torch.no_grad()
    def resume_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        """Take the ``tags`` back (all by default). Resumed weights hold undefined values (NaN)
        until pushed again, unless they were backed up."""
        tags = [t for t in memory_tags(tags) if t in self._released]
        if "weights" in tags:
            for n, p in self._params.items():
                p.data = torch.full(self._shapes[n], float("nan"), dtype=p.dtype, device=p.device)
            if self._backup is not None:
                for n, p in self._params.items():
                    p.copy_(self._backup[n])
                self._backup = None
            else:
                self._stale = set(self._params)
        self._released.difference_update(tags)

    def flush_cache(self) -> None:
        """No prefix cache is kept between calls: nothing to flush."""

    def shutdown(self) -> None:
        """Drop the model."""
        self.model = None
        self._params = {}


def _first_stop(text: str, stops: Sequence[str]) -> Optional[int]:
    """Index in ``text`` where the earliest stop string starts, or None."""
    hits = [text.index(s) for s in stops if s and s in text]
    return min(hits) if hits else None


class _StopStrings:
    """A ``transformers`` stopping criterion: a row is done once its decoded completion
    contains a stop string. Works with any tokenizer (decodes instead of matching tokens)."""

    def __init__(self, tokenizer, prompt_width: int, stops: Sequence[str]) -> None:
        self.tokenizer, self.width, self.stops = tokenizer, prompt_width, list(stops)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        done = [_first_stop(self.tokenizer.decode(row[self.width:], skip_special_tokens=True), self.stops)
                is not None for row in input_ids.tolist()]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


class _RouterCapture:
    """The top-k experts of every router call during one ``model.generate`` (a context manager).

    transformers' Qwen3-MoE router (``mlp.gate`` of a sparse layer) returns ``(logits, weights,
    indices)``; a forward hook keeps the indices of each call: ``[rows * width, k]`` for the prefill
    of the left-padded prompts ``[rows, width]``, then ``[rows, k]`` per generated token.
    """

    def __init__(self, model: torch.nn.Module, enabled: bool, rows: int, width: int) -> None:
        self._layers = list(model.model.layers) if enabled else []
        self._calls: list[list[torch.Tensor]] = [[] for _ in self._layers]
        self._hooks: list = []
        self._k = getattr(model.config, "num_experts_per_tok", 0)
        self._rows, self._width = rows, width
        if enabled and not any(self._gate(layer) is not None for layer in self._layers):
            raise ValueError("routed_experts needs a mixture-of-experts model; this one has no routers")

    @staticmethod
    def _gate(layer: torch.nn.Module) -> Optional[torch.nn.Module]:
        mlp = getattr(layer, "mlp", None)
        return mlp.gate if hasattr(mlp, "experts") and isinstance(getattr(mlp, "gate", None), torch.nn.Module) else None

    def __enter__(self) -> _RouterCapture:
        for calls, layer in zip(self._calls, self._layers):
            gate = self._gate(layer)
            if gate is not None:
                self._hooks.append(gate.register_forward_hook(
                    lambda _m, _args, out, calls=calls: calls.append(out[2].detach().to("cpu", torch.int32))))
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def of_row(self, row: int, prompt_len: int, n: int) -> torch.Tensor:
        """Row ``row``'s experts ``[prompt_len + n - 1, layers * k]`` (its ``n`` kept generated tokens)."""
        positions = prompt_len + n - 1
        out = torch.full((positions, len(self._layers), self._k), -1, dtype=torch.int32)
        for layer, calls in enumerate(self._calls):
            if not calls:
                continue  # a dense layer
            prefill = calls[0].reshape(self._rows, self._width, -1)[row, self._width - prompt_len:]
            steps = [c.reshape(self._rows, -1)[row:row + 1] for c in calls[1:n]]
            out[:, layer] = torch.cat([prefill, *steps])
        return out.reshape(positions, -1)


def _first(*values):
    for v in values:
        if isinstance(v, list):
            v = v[0] if v else None
        if v is not None:
            return v
    return None
