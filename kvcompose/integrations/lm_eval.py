"""lm-evaluation-harness model `kvcompose`: Hugging Face generation with a fresh compressing `KVComposeCache`.

`KVComposeLM` subclasses lm-eval's `HFLM` (so batching, chat templates, stop sequences, `accelerate` data
parallelism and every task work as for `--model hf`) and only changes generation: each `generate` call
(one batch of `generate_until` requests) gets a new `KVComposeCache(model, preset, budget=..., ...)`.

    # Python
    import kvcompose.integrations.lm_eval            # registers "kvcompose"
    lm_eval.simple_evaluate(model="kvcompose", model_args="pretrained=Qwen/Qwen3-8B,method=rkv,budget=512",
                            tasks=["gsm8k"])
    lm_eval.simple_evaluate(model=KVComposeLM(pretrained=model_object, tokenizer=tok, method="h2o", budget=64),
                            tasks=[...])

    # command line: lm-eval's own CLI with the model registered first
    kvcompose-lm-eval --model kvcompose --model_args pretrained=Qwen/Qwen3-8B,method=rkv,budget=512 --tasks gsm8k
    python -m kvcompose.integrations.lm_eval --model kvcompose --model_args ... --tasks gsm8k

Plugins: lm-eval 0.4.13 (the version `pip install lm-eval` gives at the time of writing) discovers models only
from its built-in table and from `@register_model` in code that has been imported; it reads no entry points.
So the bare `lm_eval --model kvcompose ...` cannot find the model; `kvcompose-lm-eval` (or
`python -m kvcompose.integrations.lm_eval`) is that same CLI after `import kvcompose.integrations.lm_eval`.

model_args (besides HFLM's own: `pretrained`, `tokenizer`, `dtype`, `device`, `batch_size`, `gguf_file`, ...):
    method: a preset of `kvcompose.methods.PRESETS` (default "rkv"; "full" = no compression).
    budget: tokens kept per layer and KV head (required unless method=full).
    interval: decoded tokens between compression events (default: the preset's own).
    seed: seed of the cache's random selectors (default 0).
    compress_prefill: also compress the prompt right after prefill (default false).
    pretrained: a model name / directory, an already-built `PreTrainedModel` (pass `tokenizer=` too), or
        "default" for kvcompose's SmolLM2-135M-Instruct GGUF.

Log-likelihood requests (`loglikelihood`, `loglikelihood_rolling`, i.e. multiple-choice and perplexity tasks)
are scored with the FULL cache: they are one forward pass over context + continuation, during which a
compressing cache never compresses (compression happens between decoded tokens). A warning says so once.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

try:
    from lm_eval.api.registry import model_registry
    from lm_eval.models.huggingface import HFLM
except ImportError as e:  # pragma: no cover - only without the eval extra
    from ..view import KVComposeError

    raise KVComposeError("kvcompose.integrations.lm_eval needs lm-eval: pip install 'kvcompose[eval]'") from e

from ..view import KVComposeError

__all__ = ["KVComposeLM", "main"]

log = logging.getLogger(__name__)


def _as_int(name: str, v: Any) -> int | None:
    if v is None or (isinstance(v, str) and v.lower() in ("", "none")):
        return None
    if isinstance(v, bool):
        raise KVComposeError(f"{name} must be an integer, got {v!r}")
    try:
        return int(v)
    except (TypeError, ValueError):
        raise KVComposeError(f"{name} must be an integer, got {v!r}") from None


class KVComposeLM(HFLM):
    """lm-eval's `HFLM` whose `generate` calls run with a fresh compressing `KVComposeCache` each.

    Args:
        pretrained: model name/directory, a `PreTrainedModel` object (then pass `tokenizer`), or "default".
        method: kvcompose preset name (`kvcompose.methods.PRESETS`).
        budget: tokens kept per layer and KV head after each compression event.
        interval: decoded tokens between compression events (None = the preset's default).
        seed: seed of the cache's per-layer generators.
        compress_prefill: compress the prompt right after prefill too.
        **kwargs: everything `HFLM` accepts (`tokenizer`, `device`, `dtype`, `batch_size`, ...).

    Attributes:
        cache_log: one dict per `generate` call: rows, peak HBM KV bytes of the batch, compression events.
    """

    def __init__(self, pretrained: Any = "default", method: str = "rkv", budget: Any = None, interval: Any = None,
                 seed: Any = 0, compress_prefill: bool = False, **kwargs):
        from .. import methods as _methods
        from ..methods import preset

        if method not in _methods.PRESETS:
            raise KVComposeError(f"unknown method {method!r}; presets: {', '.join(_methods.PRESETS)}")
        budget, interval, seed = _as_int("budget", budget), _as_int("interval", interval), _as_int("seed", seed)
        if method != "full":
            if budget is None or budget <= 0:
                raise KVComposeError(f"method {method!r} needs a positive budget (model_args ...,budget=512)")
            preset(method, budget=budget).validate(budget)
        if interval is not None and interval <= 0:
            raise KVComposeError(f"interval must be positive, got {interval}")
        if pretrained is None or pretrained == "default":
            from ..models import load_default_model

            pretrained, tok = load_default_model()
            kwargs.setdefault("tokenizer", tok)
        if not isinstance(pretrained, str):
            if kwargs.get("tokenizer") is None:
                raise KVComposeError("with a model object as `pretrained`, pass its `tokenizer` too")
            for k in ("device", "dtype"):  # HFLM ignores them for a built model; drop its defaults quietly
                kwargs.pop(k, None)
        super().__init__(pretrained=pretrained, **kwargs)
        self.kv_method, self.kv_budget, self.kv_interval, self.kv_seed = method, budget, interval, seed
        self.kv_compress_prefill = bool(compress_prefill)
        self.cache_log: list[dict[str, Any]] = []
        self._warned_loglikelihood = False

    def make_cache(self):
        """A fresh `KVComposeCache` for one `generate` call."""
        from .. import methods as _methods
        from ..methods import preset
        from ..cache import KVComposeCache

        if self.kv_method == "full":
            return KVComposeCache(self.model, _methods.full(), seed=self.kv_seed)
        kw: dict[str, Any] = {"seed": self.kv_seed, "compress_prefill": self.kv_compress_prefill}
        if self.kv_interval is not None:
            kw["interval"] = self.kv_interval
        return KVComposeCache(self.model, preset(self.kv_method, budget=self.kv_budget), budget=self.kv_budget, **kw)

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        cache = self.make_cache()
        generation_kwargs["past_key_values"] = cache
        out = super()._model_generate(context, max_length, stop, **generation_kwargs)
        mem = cache.memory()
        self.cache_log.append({"rows": int(context.shape[0]), "peak_kv_bytes": int(mem.peak.get("hbm", mem.total)),
                               "full_cache_bytes": int(mem.full_cache), "compress_calls": cache.stats.compress_calls})
        return out

    def _warn_full(self) -> None:
        if not self._warned_loglikelihood and self.kv_method != "full":
            log.warning("kvcompose: log-likelihood requests are scored with the full cache (one forward pass; "
                        "compression applies to generation only)")
            self._warned_loglikelihood = True

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        """Scored with the full cache (see the module docstring)."""
        self._warn_full()
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        """Scored with the full cache (see the module docstring)."""
        self._warn_full()
        return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        info.update({"kvcompose_method": self.kv_method, "kvcompose_budget": self.kv_budget,
                     "kvcompose_interval": self.kv_interval})
        return info


def _register() -> None:
    """Register `kvcompose` in lm-eval's model registry (lazily, by import path; idempotent)."""
    try:
        model_registry.register("kvcompose", target="kvcompose.integrations.lm_eval:KVComposeLM")
    except ValueError:  # already registered: the class itself after a lookup, or this module imported twice
        pass


_register()


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line with the `kvcompose` model registered (the `kvcompose-lm-eval` script)."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":  # run the package's copy of this module, the one the registry resolves
    from kvcompose.integrations.lm_eval import main as _main

    _main()
