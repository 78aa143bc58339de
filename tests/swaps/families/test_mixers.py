"""Linear-attention and SSM mixers have no accel-patch op: the report names each mixer class and
what transformers runs in it (its torch reference, or the package's kernels), read from
transformers' own fallback wrappers."""
from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch

import accel_patch
from accel_patch.swaps.layers import mixers

transformers = pytest.importorskip("transformers")

HYBRIDS = {
    "Qwen3NextConfig": ("Qwen3NextGatedDeltaNet", "flash-linear-attention", dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_value_heads=2, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention"])),
    "NemotronHConfig": ("NemotronHMamba2Mixer", "mamba-ssm", dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=1,
        hybrid_override_pattern="M*")),
    "Lfm2Config": ("Lfm2ShortConv", "causal-conv1d", dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, layer_types=["conv", "full_attention"])),
}


@pytest.mark.parametrize("config_name", sorted(HYBRIDS))
def test_the_report_names_each_mixer_and_what_runs_there(config_name):
    if not hasattr(transformers, config_name):
        pytest.skip(f"transformers has no {config_name}")
    mixer, dist, kwargs = HYBRIDS[config_name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_name)(**kwargs))
    if not hasattr(sys.modules[type(model).__module__], "use_kernel_func_from_hub_with_fallback"):
        pytest.skip("this transformers picks the mixer's kernels another way")
    report = accel_patch.report(model) or accel_patch.swap_kernels(model)
    assert mixer in report.mixers, report.mixers
    n, what = report.mixers[mixer]
    assert n == 1 and f"torch reference, no {dist} (pip install {dist})" in what, what
    assert "mixer  " in str(report) and mixer in str(report)
    assert "mixers 1: torch reference" in report.short() and len(report.short()) <= 100


def test_a_mixer_whose_package_transformers_found_is_named_with_that_package():
    from transformers.integrations import hub_kernels

    if not hasattr(hub_kernels, "use_kernel_func_from_hub_with_fallback"):
        pytest.skip("transformers has no kernel fallback wrappers")
    package = types.ModuleType("accel_patch_test_fake_kernels")

    def scan(x):
        return x * 2

    package.scan = scan
    family = types.ModuleType("accel_patch_test_fake_family")
    sys.modules[package.__name__] = package
    sys.modules[family.__name__] = family
    try:
        exec(
            "import torch\n"
            "from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback\n"
            "@use_kernel_func_from_hub_with_fallback('scan', 'accel_patch_test_fake_kernels')\n"
            "def scan(x):\n    return x * 2\n"
            "@use_kernel_func_from_hub_with_fallback('conv', 'accel_patch_test_no_such_package')\n"
            "def conv(x):\n    return x\n"
            "class Mixer(torch.nn.Module):\n"
            "    def forward(self, x):\n        return self.inner(x)\n"
            "    def inner(self, x):\n        return conv(scan(x))\n",
            family.__dict__)
        what = mixers.what_runs(family.Mixer())
        assert "accel_patch_test_fake_kernels's kernels: scan" in what, what
        assert "torch reference, no accel_patch_test_no_such_package" in what and "conv" in what, what
        assert mixers.what_runs(torch.nn.Linear(2, 2)) is None
    finally:
        del sys.modules[package.__name__], sys.modules[family.__name__]


@pytest.mark.slow  # reads every modeling file of transformers and imports a few
def test_check_names_each_mixer_package_its_families_and_what_runs():
    from transformers.integrations import hub_kernels

    if not hasattr(hub_kernels, "use_kernel_func_from_hub_with_fallback"):
        pytest.skip("transformers has no kernel fallback wrappers")
    from accel_patch.cli import check

    rows = {r.name: r for r in check.check_mixers()}
    for config_name, (_, dist, _) in HYBRIDS.items():
        if not hasattr(transformers, config_name):
            continue
        row = rows[dist]
        assert row.part == "mixers" and row.ok  # information, never a failure
        expected = "torch reference" if importlib.util.find_spec(
            {v: k for k, v in mixers.DISTRIBUTIONS.items()}[dist]) is None else f"{dist}'s kernels"
        assert row.figure == expected and (f"pip install {dist}" in row.detail) == (expected == "torch reference")
    families = mixers.kinds()["fla"][0]
    assert {"qwen3_next", "kimi_linear"} <= set(families), families
