"""GPU code generation without a GPU: the launches the host code makes at real model shapes compile
for sm_80 and sm_90a within register, spill and shared-memory budgets (accel_kernels.codegen).

The compiles run in a process without the interpreter (codegen.run starts it): here the kernels
are interpreter functions.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import accel_kernels._launch as launch
import accel_kernels.ops.layer_norm as layer_norm_module
import accel_kernels.ops.rms_norm as rms_norm_module
from accel_kernels import codegen

from accel_kernels import _triton
from test_launch import kernels

pytestmark = pytest.mark.skipif(not _triton.AVAILABLE, reason=f"triton cannot be imported: {_triton.IMPORT_ERROR}")


def _check_matrix(records, expected_kernels):
    assert records, "no configuration captured"
    failed = [r for r in records if not r["ok"]]
    assert not failed, codegen.table(failed)
    for target in codegen.TARGETS:
        seen = {r["kernel"] for r in records if r["target"] == target}
        assert seen == expected_kernels, f"{target}: {expected_kernels - seen} never compiled"
    for r in records:
        assert r["registers"] and r["blocks_per_sm"] >= 1 and r["shared"] >= 0, r
    # the norms' backward grids have as many programs as are resident at once: at
    # least what the host sizes them for must fit a SM
    sized = {"_rms_norm_bwd_kernel": rms_norm_module, "_layer_norm_bwd_kernel": layer_norm_module}
    for r in records:
        if r["kernel"] in sized:
            host_per_sm = max(1, 65536 // (32 * r["num_warps"] * sized[r["kernel"]]._BWD_REGISTERS))
            assert r["blocks_per_sm"] >= host_per_sm, r


@pytest.fixture(scope="module")
def quick_records():
    """The quick matrix's records, compiled once for the tests of this module that read them."""
    return codegen.run(quick=True)


@pytest.mark.slow  # over 2 s: a compile per configuration (the whole matrix is slow too)
def test_quick_matrix_compiles_within_budgets(quick_records):
    records = [dict(r) for r in quick_records]
    # the dot passes only run for rows wider than 8192: Llama-3-405B and BLOOM-176B in the whole matrix
    _check_matrix(records, set(kernels()) - {"_rms_norm_bwd_dot_kernel", "_layer_norm_bwd_dot_kernel"})
    assert {r["dtype"] for r in records} == set(codegen.QUICK_DTYPES)
    print("\n" + codegen.table(records))


@pytest.mark.slow
def test_check_codegen_part_prints_each_configuration_and_fails_on_a_bad_one(quick_records, monkeypatch, capsys):
    from accel_patch.cli import check

    records = [dict(r) for r in quick_records]  # `accel-patch check` reads the whole matrix: the quick one here
    monkeypatch.setattr(codegen, "run", lambda quick=False: [dict(r) for r in records])
    assert check.main(parts=("codegen",)) == 0
    out = capsys.readouterr().out
    assert out.count("\ncodegen ") == len(records) and "regs, spill" in out and "/SM" in out
    bad = dict(records[0], ok=False, problems=["255 registers > 128 at 16 warps"])
    monkeypatch.setattr(codegen, "run", lambda quick=False: [bad] + records[1:])
    assert check.main(parts=("codegen",)) == 1
    assert "255 registers > 128 at 16 warps" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.audit  # ~7 min beside the suite on 2 cores: .ci/run runs it alone, `pytest -m audit`
@pytest.mark.timeout(900)
def test_whole_matrix_compiles_within_budgets():
    records = codegen.run(quick=False)
    _check_matrix(records, set(kernels()))
    assert {r["dtype"] for r in records} == set(codegen.DTYPES)
    models = {m.split("/")[0] for r in records for m in r["models"]}
    assert models == set(codegen.MODELS) | set(codegen.MOE_MODELS) | set(codegen.LAYER_NORM_MODELS)
    print("\n" + codegen.table(records))


def test_budgets_and_occupancy():
    assert [codegen.register_budget(w) for w in (1, 4, 8, 16, 32)] == [255, 255, 255, 128, 64]
    h100 = codegen.TARGETS["sm_90"]
    assert codegen.blocks_per_sm(92, 16384, 16, h100) == 1  # 3072 registers a warp: 21 warps a SM
    assert codegen.blocks_per_sm(64, 0, 16, h100) == 2
    assert codegen.blocks_per_sm(32, 0, 4, h100) == 16  # the thread limit: 2048 / 128
    assert codegen.blocks_per_sm(32, 100 * 1024, 4, h100) == 2  # shared memory
    good = dict(kernel="k", num_warps=16, registers=128, spill_stores=64, spill_loads=64, shared=227 * 1024)
    assert codegen._judge(dict(good), h100)["ok"]
    for change, words in ((dict(registers=129), "129 registers > 128 at 16 warps"),
                          (dict(spill_stores=65), "spills 65 B > 64 B"),
                          (dict(shared=227 * 1024 + 1), "shared 232449 B > 232448 B"),
                          (dict(error="CompilationError: boom"), "compile error")):
        record = codegen._judge(dict(good, **change), h100)
        assert not record["ok"] and any(words in p for p in record["problems"]), record


def test_capturing_records_and_launches_nothing(device):
    x, w = torch.randn(6, 40, device=device), torch.ones(40, device=device)
    with launch.recording() as launched, launch.capturing() as launches:
        y, (_, _, rstd, _) = rms_norm_module._forward_triton(x, w, 1e-6, 0.0, "llama")
    assert torch.isnan(y).all() and torch.isnan(rstd).all()  # the poisoned outputs were never written
    assert launched == ["_rms_norm_fwd_kernel"]
    [captured] = launches
    assert captured.name == "_rms_norm_fwd_kernel" and captured.grid == (1,)
    assert captured.args[0].data_ptr() == x.data_ptr() and captured.meta["CASTING"] == 0 and "num_warps" in captured.meta
    y, _ = rms_norm_module._forward_triton(x, w, 1e-6, 0.0, "llama")  # outside the block: runs again
    assert torch.isfinite(y).all()


RULE_EQUALS_BINDER = r'''
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from accel_kernels import _launch, codegen

backend = make_backend(GPUTarget("cuda", 90, 32))
n = 0
for name in ("Gemma-2-9B", "Phi-4-mini"):
    for tokens in (4096, 8191):
        with _launch.capturing() as launches:
            codegen._drive(codegen.MODELS[name], torch.bfloat16, tokens)
        for l in launches:
            args = [codegen._Pointer(a) if isinstance(a, torch.Tensor) else a for a in l.args]
            by_binder = codegen._specialize(l.kernel, l.args, l.meta, backend)
            by_rule = codegen._specialize_by_rule(l.kernel, args, l.meta, backend)
            assert codegen.specialization_key(*by_binder[:3]) == codegen.specialization_key(*by_rule[:3]), (
                l.name, by_binder[:3], by_rule[:3])
            assert by_binder[3].num_warps == by_rule[3].num_warps
            n += 1
print(n)
'''


@pytest.mark.slow  # over 2 s: a subprocess or a Trainer run
def test_specialization_rule_is_the_jit_binders():
    # the rule is what codegen falls back on where triton has no binder API: it must agree with it
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", RULE_EQUALS_BINDER], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split()[-1]) > 20
