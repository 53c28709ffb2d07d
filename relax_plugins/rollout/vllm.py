"""``vllm``: a rollout backend on vLLM's v1 async engine (``AsyncLLM``).

The engine runs in its own processes (an engine core and one worker per rank, spawned by vLLM);
this object drives it from a private asyncio loop on a background thread, so ``generate`` and
``load_weights`` stay the plain blocking calls the runtime makes. Prompts are tokenized here
exactly as the ``hf`` backend does and handed to vLLM as token ids; responses are decoded here too.

Behaviour log-probs: the engine runs with ``logprobs_mode="processed_logprobs"``, so each reported
log-prob is that of the distribution the token was sampled from: ``log softmax(logits / T)``,
after top-k / top-p truncation when those are set. With temperature 1, top_p 1 and top_k 0 that is
the model's own distribution; with T != 1 it is what the ``torch`` trainer computes (it divides by
the rollout's temperature); truncation is not reproduced by the trainer (as with ``hf``). Greedy
decoding (temperature 0) reports the log-probs of the unscaled model, which is what the trainer
uses then (T = 1).

Weights: ``load_weights`` pauses the engine (in-flight requests finish first), sends the full
``state_dict`` as raw bytes to every worker through ``collective_rpc``, where
``relax_plugins.rollout.vllm_worker.WeightReceiver`` feeds it to the worker's own
``reload_weights``, then clears the prefix cache and resumes. No pickled code crosses to the engine
(``VLLM_ALLOW_INSECURE_SERIALIZATION`` stays off). A tied ``lm_head.weight`` is always pushed: vLLM's
CPU backend keeps a prepacked copy of every linear layer, which is refreshed only for the tensors
pushed. The transport is the engine's own ZMQ and shared-memory channels on one machine.

With ``roles.rollout.weight_sync: collective`` the weights instead come over a weight group
(``relax.weight_group``): ``join_weight_group`` has each worker join as rank 1 + its rank,
``receive_weights`` pauses the engine, has every worker receive the trainer's broadcast (NCCL on
GPUs, gloo on CPU) and load it bucket by bucket, then clears the prefix cache and resumes.

Multi-turn rollouts call ``generate_tokens``: token prompts (a trajectory's tokens so far) go to the
engine as they are, each with its own budget, and come back with one sample each. The engine serves at
most ``max_model_len`` tokens per sequence, by default ``data.max_prompt_tokens`` plus the
trajectory's budget (``roles.rollout.agent.max_tokens``, from the context) in agentic runs (a prompt
that does not fit with its budget is refused with advice). Media observations need the ``hf``
backend.

Routing (``algorithm.router_replay: r3``, ``context.record_routing``): the engine starts with vLLM's
routed-experts capture (``enable_return_routed_experts``), which returns per request the top-k expert
ids of every decoder layer at each position it routed, ``[positions, layers, k]``. Each request asks
for positions from its prompt's last token on (``routed_experts_prompt_start = P - 1``), so a row of
``P`` prompt and ``R`` response tokens comes back with positions ``P - 1 .. P + R - 2``: exactly
``Generation.routed_experts`` (``relax_plugins.moe_routing``), once the dense layers' entries are
dropped (``moe_layer_indices``). vLLM keeps the routing of cached prefix blocks beside the KV cache
and forgets it when the prefix cache is reset (after every weight push). Its capture runs only in
vLLM's model runner V2, which needs Triton (triton-cpu on CPUs), and only with prefix caching on;
where either is missing the backend refuses ``record_routing`` when it is built, naming the cause.

Stop strings (``sampling.stop``) go to the engine (``SamplingParams.stop``, which needs its
detokenizer on while they are set); the response's tokens are then cut where
``relax.algo.stop_strings`` finds the first one complete, exactly as the ``hf`` backend does: the
token that completes it is the response's last (in the loss, like a stop token), the text ends
before the string (vLLM's own ``include_stop_str_in_output=False``). The repetition penalty
(``sampling.repetition_penalty``) is vLLM's, the same CTRL penalty on prompt and response tokens.

Seeding: every sample is its own request with a seed drawn from ``(seed, row)``, and a call's
requests are queued while the scheduler is paused and released together, so the same weights,
prompts and seed give the same batches and the same generations.

This module imports only pydantic and the standard library at the top (``relax validate`` reads its
``Config``); vLLM, torch and transformers are imported when an engine is built.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from relax.contracts import Generation, RolloutContext, TokenPrompt
from relax.environment import temporarily_set

GIB = 1 << 30
#: Where the worker-side half lives (vLLM imports it in its worker processes).
WORKER_EXTENSION = "relax_plugins.rollout.vllm_worker.WeightReceiver"
#: The longest a single engine call (start, generate, weight push) may take before it is an error.
CALL_TIMEOUT_S = float(os.environ.get("RELAX_VLLM_TIMEOUT_S", "900"))
#: How long the engine's processes get to exit on ``close`` before vLLM kills them.
SHUTDOWN_TIMEOUT_S = 15.0


class VLLMRollout:
    """Samples responses with vLLM; seeded, so the same weights, prompts and seed give the same
    generations."""

    #: Only token prompts are fed to the engine; media inputs would need vLLM's multimodal inputs.
    modalities: ClassVar[frozenset[str]] = frozenset({"text"})
    #: Replicas are data parallel; tp, pp and ep are the engine's own tensor, pipeline and expert
    #: parallelism (GPUs only: the CPU backend runs one worker).
    parallelism: ClassVar[frozenset[str]] = frozenset({"dp", "tp", "pp", "ep"})
    #: It records MoE routing for replay through vLLM's routed-experts capture (where the engine
    #: can capture: model runner V2 with Triton; refused at build time elsewhere).
    router_replay: ClassVar[frozenset[str]] = frozenset({"r3"})
    #: ``generate_tokens`` honours ``pause`` (streamed outputs; the running requests are aborted at
    #: the pause): partial rollouts (``roles.rollout.partial``) swap weights there and continue.
    pausable: ClassVar[bool] = True
    #: Serves the actor's LoRA adapter: a LoRARequest with a new id per version (vllm_lora.ServedAdapter).
    lora_adapters: ClassVar[bool] = True
    #: Token prompts may carry vLLM structured outputs (``TokenPrompt.structured_outputs``, the
    #: agent gateway's tool_choice and response_format): the engine masks the logits before its
    #: sampler, so the processed log-probs reported are the masked distribution's.
    constrained_decoding: ClassVar[frozenset[str]] = frozenset({"structured_outputs"})

    class Config(BaseModel):
        """Options of the vLLM rollout backend."""

        model_config = ConfigDict(extra="forbid")

        kv_cache_gib: float | None = Field(1.0, gt=0.0)
        """KV cache size in GiB (vLLM's ``kv_cache_memory_bytes``; on CPU it is host memory).
        Null lets vLLM size it from ``roles.rollout.gpu_memory_utilization``."""
        max_model_len: int | None = Field(None, ge=2)
        """Longest sequence (prompt plus response) the engine serves; null uses
        ``data.max_prompt_tokens + sampling.max_new_tokens``."""
        max_num_seqs: int | None = Field(None, ge=1)
        """Most sequences in one engine step; null keeps vLLM's default."""
        max_num_batched_tokens: int | None = Field(None, ge=1)
        """Most tokens in one engine step (prefill chunks included); null keeps vLLM's default."""
        enforce_eager: bool = True
        """Run the model eagerly. False lets vLLM compile it (CUDA graphs on GPUs, inductor on CPU:
        minutes of start-up on a small CPU). While true, vLLM's few ``torch.compile``d sampler helpers
        also run eagerly, which saves their first compilation (about 30 s on two CPU cores)."""
        enable_prefix_caching: bool = True
        """Reuse the KV cache of shared prompt prefixes (the n samples of a prompt); cleared after
        every weight update."""
        num_threads: int | None = Field(None, ge=1)
        """CPU backend: threads of the engine's worker (OpenMP, unbound). Null lets vLLM bind its
        worker to the free cores itself (``VLLM_CPU_OMP_THREADS_BIND=auto``)."""
        engine_args: dict[str, Any] = Field(default_factory=dict)
        """Further ``vllm.AsyncEngineArgs`` fields, passed as they are (e.g. ``block_size``);
        rejected at start-up if vLLM does not know them. The fields this backend sets itself
        (model, dtype, parallel sizes, seed, log-prob mode) cannot be overridden here."""

    #: Engine arguments derived from the context; ``engine_args`` may not override them.
    OWNED_ARGS: ClassVar[frozenset[str]] = frozenset({
        "model", "tokenizer", "dtype", "seed", "logprobs_mode", "tensor_parallel_size",
        "pipeline_parallel_size", "enable_expert_parallel", "worker_extension_cls", "generation_config",
        "skip_tokenizer_init", "kv_cache_memory_bytes", "max_model_len", "max_num_seqs",
        "max_num_batched_tokens", "enforce_eager", "enable_prefix_caching", "gpu_memory_utilization",
        "enable_return_routed_experts",
    })

    def __init__(self, config: VLLMRollout.Config, context: RolloutContext) -> None:
        from transformers import AutoConfig, AutoTokenizer

        from relax_plugins.rollout.hf import end_and_pad_ids

        self.config = config
        self.context = context
        self.model_path = context.model.path
        self.max_prompt_tokens = int(context.max_prompt_tokens)
        after_prompt = context.max_trajectory_tokens or int(context.sampling.max_new_tokens)
        self.max_model_len = config.max_model_len or self.max_prompt_tokens + after_prompt
        self._check_context(context)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        from relax_plugins.rollout.chat_template import PromptEncoder

        self.prompts = PromptEncoder(self.tokenizer, context.chat_template, int(context.max_prompt_tokens),
                                     context.on_long_prompt)
        self.eos_token_id, self.pad_token_id = end_and_pad_ids(self.tokenizer, self.model_path)
        self.hf_config = AutoConfig.from_pretrained(self.model_path)
        self.stop_token_ids = [self.eos_token_id] + [t for t in _declared_eos(self.model_path)
                                                     if t != self.eos_token_id]
        self._stops = frozenset(self.stop_token_ids)
        self.weight_shapes = _checkpoint_shapes(self.model_path)
        self.tied = bool(getattr(self.hf_config.get_text_config(), "tie_word_embeddings", False))
        if (self.tied and "lm_head.weight" not in self.weight_shapes
                and "model.embed_tokens.weight" in self.weight_shapes):
            self.weight_shapes["lm_head.weight"] = self.weight_shapes["model.embed_tokens.weight"]

        self.record_routing = bool(context.record_routing)
        self.moe_layers = moe_layer_indices(self.hf_config.get_text_config())
        """Decoder layers with a router, in model order (the capture's layers kept in the recording)."""
        self.adapter: Any = None
        """With the actor's LoRA (``context.lora``): the adapter versions served on the frozen base."""
        if context.lora is not None:
            from relax_plugins.rollout.vllm_lora import ServedAdapter

            self.adapter = ServedAdapter(context.lora, self.model_path, bool(self.moe_layers))

        import vllm  # noqa: F401  (a missing install fails here, before threads and processes)

        self._check_platform()
        self._check_routing()
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-rollout-loop", daemon=True)
        self._thread.start()
        self.engine: Any = None
        try:
            with temporarily_set(self._engine_environment()):
                self.engine = self._call(self._start_engine(self._engine_args()))
        except Exception:
            self.close()
            raise
        self.version = 0
        """The policy version of the weights held (0: the initial weights)."""

    # -- construction ---------------------------------------------------------------------------

    def _check_context(self, context: RolloutContext) -> None:
        """Settings this backend cannot serve, with what to do instead (before anything starts)."""
        extra = sorted(set(context.model.modalities) - self.modalities)
        if extra:
            raise ValueError(f"the vllm rollout feeds text only, but model.modalities lists {', '.join(extra)}; "
                             "use roles.rollout.backend hf for media, or set model.modalities to [text]")
        needed = self.max_prompt_tokens + int(context.sampling.max_new_tokens)
        if self.max_model_len < needed:
            raise ValueError(f"roles.rollout.options.max_model_len={self.max_model_len} is shorter than "
                             f"data.max_prompt_tokens + sampling.max_new_tokens = {needed}; raise it or "
                             "leave it null")
        par = context.parallel
        if par.cp > 1:
            raise ValueError(f"roles.rollout.parallel.cp={par.cp}: the vllm rollout has no context "
                             "parallelism; set it to 1")
        if par.ep > 1 and par.ep != par.tp:
            raise ValueError(f"roles.rollout.parallel.ep={par.ep}: vLLM spreads experts over the engine's "
                             f"tensor-parallel ranks, so ep must equal tp ({par.tp}) or be 1")
        owned = sorted(set(self.config.engine_args) & self.OWNED_ARGS)
        if owned:
            raise ValueError(f"roles.rollout.options.engine_args sets {', '.join(owned)}, which the vllm "
                             "rollout derives from its context (the spec) or its own options; set those there instead")

    def _check_platform(self) -> None:
        """The CPU backend's limits: one worker, and only the head sizes its attention kernel has."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        par = self.context.parallel
        if par.tp * par.pp > 1:
            raise ValueError(f"roles.rollout.parallel tp={par.tp} x pp={par.pp}: this vLLM runs on the CPU "
                             "backend, which this rollout runs as one worker; set tp and pp to 1")
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        text = self.hf_config.get_text_config()
        heads = int(getattr(text, "num_attention_heads", 0) or 0)
        head_dim = getattr(text, "head_dim", None) or (int(text.hidden_size) // heads if heads else None)
        supported = list(CPUAttentionBackend.get_supported_head_sizes())
        if head_dim is not None and int(head_dim) not in supported:
            raise ValueError(f"{self.model_path} has head_dim={head_dim}, which vLLM's CPU attention "
                             f"does not support (it supports {', '.join(map(str, supported))}); use a model "
                             "with one of those (builtin:tiny-lm: model.options.head_dim >= 32) or the hf rollout")

    def _check_routing(self) -> None:
        """Routing capture (``record_routing``): an MoE model, prefix caching on, no pipeline
        parallelism, and vLLM's model runner V2, which needs Triton (on CPUs triton-cpu); each
        missing piece is refused here, before any process starts."""
        if not self.record_routing:
            return
        if not self.moe_layers:
            raise ValueError(f"algorithm.router_replay r3 records mixture-of-experts routing, but {self.model_path} "
                             "is a dense model (no experts); set algorithm.router_replay: off")
        if not self.config.enable_prefix_caching:
            raise ValueError("roles.rollout.options.enable_prefix_caching is false, but vLLM's routed-experts capture "
                             "(algorithm.router_replay r3) needs prefix caching; set it to true")
        if self.context.parallel.pp > 1:
            raise ValueError(f"roles.rollout.parallel.pp={self.context.parallel.pp}: vLLM's routed-experts capture "
                             "(algorithm.router_replay r3) does not support pipeline parallelism; set pp to 1")
        import vllm
        from vllm.platforms import current_platform
        from vllm.triton_utils import HAS_TRITON

        if not HAS_TRITON:
            needed = ("triton-cpu (vLLM's CPU build uses Triton's CPU backend)" if current_platform.is_cpu()
                      else "Triton")
            raise ValueError(f"algorithm.router_replay r3 with the vllm rollout needs vLLM's routed-experts capture, "
                             f"which vLLM {vllm.__version__} runs only in its model runner V2, and that needs "
                             f"{needed}: this environment has no usable Triton. Install it in the rollout's "
                             "environment, or use roles.rollout.backend hf (which records routing itself), or "
                             "set algorithm.router_replay: r2 or off")

    def _engine_args(self) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs

        context, config = self.context, self.config
        args: dict[str, Any] = dict(
            model=self.model_path,
            dtype=context.model.dtype,
            seed=int(self.context.seed),
            logprobs_mode="processed_logprobs",
            generation_config="vllm",  # sampling comes from the run, not the model's defaults
            worker_extension_cls=WORKER_EXTENSION,
            tensor_parallel_size=context.parallel.tp,
            pipeline_parallel_size=context.parallel.pp,
            enable_expert_parallel=context.parallel.ep > 1,
            max_model_len=self.max_model_len,
            enforce_eager=config.enforce_eager,
            enable_prefix_caching=config.enable_prefix_caching,
            gpu_memory_utilization=context.gpu_memory_utilization,
            disable_log_stats=True,
        )
        if self.record_routing:
            args["enable_return_routed_experts"] = True
        if self.adapter is not None:
            args.update(self.adapter.engine_args())
        if config.kv_cache_gib is not None:
            args["kv_cache_memory_bytes"] = int(config.kv_cache_gib * GIB)
        if config.max_num_seqs is not None:
            args["max_num_seqs"] = config.max_num_seqs
        if config.max_num_batched_tokens is not None:
            args["max_num_batched_tokens"] = config.max_num_batched_tokens
        try:
            return AsyncEngineArgs(**args, **config.engine_args)
        except TypeError as exc:
            raise ValueError(f"roles.rollout.options.engine_args: {exc}; give fields of vllm.AsyncEngineArgs") from exc

    def _engine_environment(self) -> dict[str, str]:
        """Variables the engine's processes start with (they are spawned with this process's
        environment, which is restored once they run)."""
        env = {}
        if self.config.num_threads is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
            env["OMP_NUM_THREADS"] = str(self.config.num_threads)
        if self.config.enforce_eager:
            env["TORCHDYNAMO_DISABLE"] = "1"
        if self.record_routing:
            env["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # the only runner with routed-experts capture
        return env

    async def _start_engine(self, args: Any) -> Any:
        from vllm.v1.engine.async_llm import AsyncLLM

        try:
            return AsyncLLM.from_engine_args(args)
        except Exception as exc:
            raise RuntimeError(f"vLLM could not start an engine for {self.model_path}: "
                               f"{type(exc).__name__}: {exc}. Check roles.rollout.options (kv_cache_gib, "
                               "max_model_len, engine_args) and model.dtype") from exc

    def _call(self, coroutine: Any) -> Any:
        """Run a coroutine on the engine's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(CALL_TIMEOUT_S)

    # -- generation ---------------------------------------------------------------------------

    def encode_prompt(self, prompt: str) -> list[int]:
        """Token ids of a prompt: rendered by ``data.chat_template`` and cut from the left to
        ``data.max_prompt_tokens``, as ``hf`` does (``relax_plugins.rollout.chat_template``)."""
        return self.prompts(prompt)

    def sampling_params(self, sampling: Any, seed: int, max_tokens: int | None = None,
                        prompt_tokens: int | None = None, streamed: bool = False,
                        structured: dict[str, Any] | None = None) -> Any:
        """vLLM's ``SamplingParams`` for one sample (one request) of the spec's sampling block;
        ``max_tokens`` is the request's own budget (None: ``sampling.max_new_tokens``).
        ``prompt_tokens`` (the request's prompt length; needed when recording routing) has the
        engine return routing from the prompt's last token on, the positions R3 keeps.
        ``streamed``: every output so far, as it grows (a request a partial rollout may pause).
        ``structured``: ``StructuredOutputsParams`` keyword arguments the response must follow."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        budget = int(sampling.max_new_tokens if max_tokens is None else max_tokens)
        stop = list(getattr(sampling, "stop", ()) or ())
        common = dict(n=1, max_tokens=budget, logprobs=0, seed=seed,
                      stop_token_ids=list(self.stop_token_ids), detokenize=bool(stop),
                      output_kind=RequestOutputKind.CUMULATIVE if streamed else RequestOutputKind.FINAL_ONLY)
        if stop:  # the engine stops on them; _generation cuts the tokens where they complete
            common.update(stop=stop, include_stop_str_in_output=False)
        penalty = float(getattr(sampling, "repetition_penalty", 1.0))
        if penalty != 1.0:
            common["repetition_penalty"] = penalty
        if structured is not None:
            from vllm.sampling_params import StructuredOutputsParams

            common["structured_outputs"] = StructuredOutputsParams(**structured)
        if self.record_routing:
            if not prompt_tokens:
                raise ValueError("sampling_params needs prompt_tokens while recording routing (r3)")
            common["routed_experts_prompt_start"] = int(prompt_tokens) - 1
        if sampling.temperature <= 0:
            return SamplingParams(temperature=0.0, **common)
        return SamplingParams(temperature=float(sampling.temperature), top_p=float(sampling.top_p),
                              top_k=int(sampling.top_k), **common)

    def generate(self, prompts: list[str], n: int, sampling: Any, seed: int) -> list[Generation]:
        """``n`` samples of each prompt, prompt-major (``prompt_index`` = index into ``prompts``)."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        encoded = self.prompts.encode_all(list(prompts))  # each distinct prompt once
        rows = [(index, ids) for index, ids in enumerate(encoded) for _ in range(n)]
        params = [self.sampling_params(sampling, _row_seed(seed, row), prompt_tokens=len(ids))
                  for row, (_, ids) in enumerate(rows)]
        return self._sample(rows, params, self._stop_strings(sampling))

    def _stop_strings(self, sampling: Any) -> Any:
        """The sampling's stop strings (``relax.algo.stop_strings.StopStrings``); None without any."""
        stop = tuple(getattr(sampling, "stop", ()) or ())
        if not stop:
            return None
        from relax.algo.stop_strings import StopStrings

        return StopStrings(self.tokenizer, stop)

    def generate_tokens(self, prompts: list[TokenPrompt], sampling: Any, seed: int,
                        pause: Callable[[list[bool]], bool] | None = None) -> list[Generation]:
        """One sample of each token prompt, in order (``prompt_index`` = index into ``prompts``): a
        multi-turn trajectory's next model turn. The ids go to the engine as they are (never
        re-tokenized, never cut, so the trainer sees exactly what the model saw); each prompt has its
        own budget (``max_new_tokens``, None: ``sampling.max_new_tokens``) and its own seed from
        ``(seed, index)``, as the rows of ``generate``.

        ``pause`` (partial rollouts) is asked whenever a request's output grows, with each row's
        state (True once it ended or used its budget); when it answers True the unfinished requests
        are aborted and every row comes back as far as its last output got (whole tokens with their
        log-probs), so the caller can continue it, with other weights, from its tokens."""
        rows, params, budgets = [], [], []
        for index, prompt in enumerate(prompts):
            budget = int(sampling.max_new_tokens if prompt.max_new_tokens is None else prompt.max_new_tokens)
            self._check_token_prompt(index, prompt, budget)
            rows.append((index, list(prompt.ids)))
            budgets.append(budget)
            params.append(self.sampling_params(sampling, _row_seed(seed, index), max_tokens=budget,
                                               prompt_tokens=len(prompt.ids), streamed=pause is not None,
                                               structured=getattr(prompt, "structured_outputs", None)))
        if not rows:
            return []
        stops = self._stop_strings(sampling)
        if pause is None:
            return self._sample(rows, params, stops)
        with self._lock:
            outputs = self._call(self._generate_until(rows, params, budgets, pause))
        return [self._generation(index, ids, output, stops) for (index, ids), output in zip(rows, outputs)]

    def _sample(self, rows: list[tuple[int, list[int]]], params: list[Any], stops: Any = None) -> list[Generation]:
        """Run one call's requests (``(prompt_index, prompt ids)`` rows, one ``SamplingParams``
        each) on the engine and convert their outputs, in the rows' order (``stops``: the
        sampling's stop strings)."""
        with self._lock:
            outputs = self._call(self._generate(rows, params))
        return [self._generation(index, ids, output, stops) for (index, ids), output in zip(rows, outputs)]

    def _check_token_prompt(self, index: int, prompt: TokenPrompt, budget: int) -> None:
        """What the engine cannot serve, refused before any request is queued (vLLM would fail a
        whole call on one bad request, or cap a response silently at ``max_model_len``)."""
        if prompt.media:
            raise ValueError(f"token prompt {index} carries {len(prompt.media)} media item(s): the vllm "
                             "backend's agentic path reads text only; use roles.rollout.backend hf for "
                             "media observations")
        if not prompt.ids:
            raise ValueError(f"token prompt {index} has no ids; every prompt needs at least one token")
        vocab = int(self.hf_config.get_text_config().vocab_size)
        bad = [t for t in prompt.ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"token prompt {index} holds ids outside the model's vocabulary [0, {vocab}): "
                             f"{bad[:5]}; build prompts with the model's own tokenizer")
        if budget < 1:
            raise ValueError(f"token prompt {index} has a budget of max_new_tokens={budget}; give at least 1 "
                             "(a trajectory with no budget left ends before it is generated)")
        needed = len(prompt.ids) + budget
        if needed > self.max_model_len:
            raise ValueError(f"token prompt {index} needs {len(prompt.ids)} prompt + {budget} new tokens = "
                             f"{needed}, more than the engine's max_model_len={self.max_model_len}; "
                             "set roles.rollout.options.max_model_len to at least data.max_prompt_tokens + "
                             "roles.rollout.agent.max_tokens")

    def _generation(self, prompt_index: int, ids: list[int], output: Any, stops: Any = None) -> Generation:
        """A ``Generation`` from one finished vLLM request: its sampled tokens with their
        log-probs (and, recording routing, each token's routed experts); finished when a stop
        token or a stop string (``stops``) ended it, the text decoded without either. Tokens after
        the one that completes a stop string are cut (``relax.algo.stop_strings``)."""
        from relax.algo.stop_strings import response_text

        completion = output.outputs[0]
        response = list(completion.token_ids)
        logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs, response)]
        finished = bool(response) and response[-1] in self._stops
        if stops:
            at = stops.end(response)
            if at is not None:
                response, logprobs, finished = response[:at], logprobs[:at], True
            elif isinstance(getattr(completion, "stop_reason", None), str):
                finished = True  # the engine saw a stop string the tail check did not (decoding edge)
        routed = (response_routing(completion.routed_experts, len(completion.token_ids), self.moe_layers)
                  if self.record_routing else None)
        return Generation(
            prompt_index=prompt_index,
            prompt_ids=list(ids),
            response_ids=response,
            logprobs=logprobs,
            text=response_text(self.tokenizer, response, finished, self.stop_token_ids, stops),
            finished=finished,
            routed_experts=routed[:len(response)] if routed is not None else None,
        )

    async def _queue(self, rows: list[tuple[int, list[int]]], params: list[Any]) -> tuple[list[str], list[Any]]:
        """Queue every request while the scheduler is paused, then release them together, so the
        engine batches a call the same way each time (same batches, same numbers). Requests and
        the resume message travel the same ordered channel to the engine core. Returns the request
        ids and their output collectors."""
        from vllm.inputs.engine import tokens_input

        engine = self.engine
        ids = [uuid.uuid4().hex for _ in rows]
        collectors = []
        await engine.pause_generation(mode="keep", clear_cache=False)
        try:
            for request_id, (_, prompt_ids), p in zip(ids, rows, params):
                collectors.append(await engine.add_request(request_id, tokens_input(list(prompt_ids)), p,
                                                           lora_request=self._lora_request()))
        except BaseException:
            await engine.abort(ids[:len(collectors)])
            raise
        finally:
            await engine.resume_generation()
        return ids, collectors

    async def _generate(self, rows: list[tuple[int, list[int]]], params: list[Any]) -> list[Any]:
        """Every request of a call to its end (``_queue``), in the rows' order."""
        ids, collectors = await self._queue(rows, params)
        try:
            return [await _final(collector) for collector in collectors]
        except BaseException:
            await self.engine.abort(ids)
            raise

    async def _generate_until(self, rows: list[tuple[int, list[int]]], params: list[Any], budgets: list[int],
                              pause: Callable[[list[bool]], bool]) -> list[Any]:
        """``_generate`` with streamed outputs, asking ``pause`` as they grow: on True the requests
        still running are aborted and each row's last output (cumulative: whole tokens so far) is
        its answer; a row with no output yet comes back empty."""
        ids, collectors = await self._queue(rows, params)
        latest: list[Any] = [None] * len(rows)
        done = [False] * len(rows)
        waiting = {asyncio.ensure_future(c.get()): i for i, c in enumerate(collectors)}
        try:
            while waiting:
                arrived, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for future in arrived:
                    i = waiting.pop(future)
                    latest[i] = output = future.result()
                    if output.finished or len(output.outputs[0].token_ids) >= budgets[i]:
                        done[i] = True
                    else:
                        waiting[asyncio.ensure_future(collectors[i].get())] = i
                if waiting and pause(list(done)):
                    break
        finally:
            for future in waiting:
                future.cancel()
            if waiting:
                await self.engine.abort([ids[i] for i in waiting.values()])
        return [output if output is not None else _no_output() for output in latest]

    # -- weights --------------------------------------------------------------------------------

    def _lora_request(self) -> Any:
        return None if self.adapter is None else self.adapter.request

    def load_weights(self, weights: dict[str, Any], version: int) -> None:
        """Replace the engine's weights in place with a full HF ``state_dict`` and record their
        policy ``version``. A tied ``lm_head.weight`` may be absent; it is pushed either way. With
        the actor's LoRA, ``weights`` are the adapter's tensors: served from the next request on
        under a new adapter id (the base is not reloaded)."""
        from relax_plugins.rollout.vllm_worker import pack

        if self.adapter is not None:
            with self._lock:
                self.adapter.load(weights, version)
            self.version = int(version)
            return

        weights = dict(weights)
        if self.tied and "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights:
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        self._check_weights(weights)
        packed = pack(weights)
        with self._lock:
            self._call(self._push(packed))
        self.version = int(version)

    def _check_weights(self, weights: dict[str, Any]) -> None:
        """Names and shapes must be those of the model's checkpoint: vLLM would otherwise fail
        half-way and leave the engine partly updated."""
        from relax_plugins.hf_weights import shape_mismatch

        problem = shape_mismatch({k: list(v.shape) for k, v in weights.items()}, self.weight_shapes)
        if problem:
            raise ValueError(problem)

    async def _push(self, packed: list[Any]) -> None:
        engine = self.engine
        await engine.pause_generation(mode="wait", clear_cache=True)
        try:
            loaded = await engine.collective_rpc("relax_load_weights", args=(packed,))
            if any(count != len(packed) for count in loaded):
                raise RuntimeError(f"a vLLM worker loaded {loaded} of {len(packed)} tensors")
            await _clear_prefix_cache(engine)
        finally:
            await engine.resume_generation()

    # -- weights through a weight group (roles.rollout.weight_sync: collective) -------------------

    @property
    def weight_group_ranks(self) -> int:
        """Ranks this engine takes in a weight group: one per worker (tp x pp)."""
        par = self.context.parallel
        return int(par.tp * par.pp)

    def join_weight_group(self, address: dict[str, Any]) -> None:
        """Have every worker join the weight group at ``address`` (``relax.weight_group``)
        as rank 1 + its own rank; the group forms on the first ``receive_weights``."""
        if self.adapter is not None:
            raise ValueError("the vllm rollout takes a LoRA adapter through the object store, not a weight group; "
                             "set roles.rollout.weight_sync: object_store")
        shapes = {k: list(v) for k, v in self.weight_shapes.items()}
        with self._lock:
            ranks = self._call(self.engine.collective_rpc("relax_join_weight_group",
                                                          args=(dict(address), shapes, self.tied)))
        if sorted(ranks) != list(range(1, self.weight_group_ranks + 1)):
            raise RuntimeError(f"vLLM's workers joined the weight group as ranks {ranks}, expected 1.."
                               f"{self.weight_group_ranks}")

    def receive_weights(self) -> int:
        """Receive one round of the joined weight group into the engine, paused around it (in-flight
        requests finish first), the prefix cache cleared after it; record and return its version."""
        with self._lock:
            version = self._call(self._receive())
        self.version = version
        return version

    async def _receive(self) -> int:
        engine = self.engine
        await engine.pause_generation(mode="wait", clear_cache=True)
        try:
            results = await engine.collective_rpc("relax_receive_weights")
            versions = {int(version) for version, _ in results}
            if len(versions) != 1 or any(count != len(self.weight_shapes) for _, count in results):
                raise RuntimeError(f"vLLM's workers received [version, tensors] {results}; expected one version "
                                   f"and {len(self.weight_shapes)} tensors each")
            await _clear_prefix_cache(engine)
        finally:
            await engine.resume_generation()
        return versions.pop()

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the engine's processes and the loop thread (idempotent)."""
        engine, self.engine = getattr(self, "engine", None), None
        adapter = getattr(self, "adapter", None)
        if adapter is not None:
            adapter.close()
        loop = getattr(self, "_loop", None)
        running = loop is not None and not loop.is_closed() and self._thread.is_alive()
        if engine is not None:
            with contextlib.suppress(Exception):
                if running:  # stop reading outputs first, so the engine's exit is not an error
                    asyncio.run_coroutine_threadsafe(_stop_output_handler(engine), loop).result(10)
                engine.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
        if running:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(_cancel_tasks(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(timeout=10)
        if loop is not None and not loop.is_closed() and not self._thread.is_alive():
            loop.close()

    def __del__(self) -> None:
        self.close()


async def _clear_prefix_cache(engine: Any) -> None:
    """Drop every cached prefix (its KV blocks, and the routing vLLM keeps beside them): after a
    weight push they hold the old weights' keys and values, and a request reusing them would be
    scored by a mix of old and new weights. vLLM reports a reset it could not do (blocks still held
    by requests); that is an error here, not a stale cache served silently."""
    if not await engine.reset_prefix_cache():
        raise RuntimeError("vLLM could not reset its prefix cache after a weight push (blocks still in use); "
                           "the engine keeps serving, but cached prefixes would mix old and new weights")


def moe_layer_indices(text_config: Any) -> list[int]:
    """The decoder layers of a Hugging Face text config that route to experts, in order (empty for
    a dense model): vLLM's capture has an entry for every decoder layer, ``Generation.routed_experts``
    one per MoE layer. Qwen2/Qwen3-MoE place experts in layers ``i`` with ``(i + 1) %
    decoder_sparse_step == 0`` outside ``mlp_only_layers``; DeepSeek-style configs keep the first
    ``first_k_dense_replace`` layers dense."""
    experts = int(getattr(text_config, "num_experts", 0) or getattr(text_config, "num_local_experts", 0)
                  or getattr(text_config, "n_routed_experts", 0) or 0)
    if experts <= 0:
        return []
    only_dense = {int(i) for i in (getattr(text_config, "mlp_only_layers", None) or [])}
    step = int(getattr(text_config, "decoder_sparse_step", 1) or 1)
    first_sparse = int(getattr(text_config, "first_k_dense_replace", 0) or 0)
    return [i for i in range(int(text_config.num_hidden_layers))
            if i not in only_dense and (i + 1) % step == 0 and i >= first_sparse]


def response_routing(captured: Any, response_tokens: int, moe_layers: list[int]) -> list[list[list[int]]]:
    """``Generation.routed_experts`` of one request from vLLM's capture (``CompletionOutput.routed_experts``,
    an array ``[positions, decoder layers, k]`` that ends at the position of the last response
    token's predecessor, ``P + R - 2``): its last ``response_tokens`` positions (``P - 1 .. P + R - 2``),
    the MoE layers' entries only, as ``[tokens][MoE layers][k]`` ints."""
    if captured is None:
        raise RuntimeError("vLLM returned no routed experts for a request although the engine captures them "
                           "(enable_return_routed_experts); the engine and this backend disagree on the capture")
    shape = tuple(getattr(captured, "shape", ()))
    if len(shape) != 3 or shape[0] < response_tokens or (moe_layers and shape[1] <= max(moe_layers)):
        raise RuntimeError(f"vLLM's routed experts have shape {shape}; expected at least {response_tokens} "
                           f"positions (one per response token) and {max(moe_layers, default=-1) + 1} layers")
    if response_tokens == 0:
        return []
    return captured[shape[0] - response_tokens:][:, moe_layers].tolist()


async def _stop_output_handler(engine: Any) -> None:
    """Cancel the engine client's output task (vLLM starts it on the first request)."""
    handler = getattr(engine, "output_handler", None)
    if handler is not None and not handler.done():
        handler.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await handler


async def _cancel_tasks() -> None:
    """Cancel and await the loop's remaining tasks (the client's socket readers) before it stops."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _final(collector: Any) -> Any:
    """The finished output of one request (``FINAL_ONLY`` requests produce just that one)."""
    while True:
        output = collector.get_nowait() or await collector.get()
        if output.finished:
            return output


def _no_output() -> Any:
    """The answer of a request paused before its first token: no tokens, no log-probs."""
    from types import SimpleNamespace

    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=[], logprobs=[], routed_experts=None)], finished=False)


def _row_seed(seed: int, row: int) -> int:
    """A sample's own seed: distinct per (call seed, row), so neighbouring calls share none."""
    digest = hashlib.blake2b(f"{seed}:{row}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def _declared_eos(model_path: str) -> list[int]:
    """End tokens of the model's generation config (chat models often declare several); what
    ``hf`` reads from ``model.generation_config``."""
    from transformers import AutoConfig, GenerationConfig

    try:
        declared = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        declared = GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_path)).eos_token_id
    declared = declared if isinstance(declared, list) else [declared] if declared is not None else []
    return [int(t) for t in declared]


def _checkpoint_shapes(model_path: str) -> dict[str, list[int]]:
    """Tensor names and shapes of a safetensors checkpoint folder, read from the file headers."""
    from safetensors import safe_open

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_path} holds no *.safetensors weights; the vllm rollout needs a local "
                                "Hugging Face folder with safetensors")
    shapes: dict[str, list[int]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                shapes[key] = list(handle.get_slice(key).get_shape())
    return shapes
