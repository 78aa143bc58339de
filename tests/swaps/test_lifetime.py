"""Every swapped model holds what its kernels need: a deep copy whose original is collected, a model
pickled and loaded again (`torch.save`/`torch.load`, multiprocessing's pickler), and a model
compiled while another swapped model is collected run the kernels their report lists, counted by
launches under the interpreter; restore still puts back exactly what was there."""
from __future__ import annotations

import copy
import gc
import io
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import transformers.models.llama.modeling_llama as modeling_llama

from accel_kernels import _launch

from accel_patch import report, restore_kernels, swap_kernels
from accel_patch.swaps import sites
from accel_patch.swaps.layers import rope

from _models import build, pair, padded_batch, rel

STOCK_ROPE = modeling_llama.apply_rotary_pos_emb
ROPE_GLOBAL = "transformers.models.llama.modeling_llama.apply_rotary_pos_emb"
# the kernel each swapped op of the tiny Llama launches in a training forward
KERNELS = {"rms_norm": "_rms_norm_fwd_kernel", "rope": "_rope_kernel", "glu": "_glu_forward_kernel",
           "fused_linear_cross_entropy": "_ce_forward_kernel"}


def launches(model, batch):
    """(loss, logits-free output, {kernel: launches}) of one forward with labels."""
    with _launch.recording() as launched:
        out = model(**batch)
    counted = {}
    for name in launched:
        counted[name] = counted.get(name, 0) + 1
    return out, counted


def test_a_deep_copy_runs_its_rope_kernel_after_the_original_is_collected(released):
    original = build("llama")
    swap_kernels(original)
    clone = copy.deepcopy(original)
    batch = padded_batch()
    _, before = launches(clone, batch)
    del original
    gc.collect()
    _, after = launches(clone, batch)
    assert before[KERNELS["rope"]] == 2 and after == before  # one launch per attention layer, still
    assert report(clone).swapped["rope"] == 2
    assert rope.interceptions.held() == {ROPE_GLOBAL: 1}  # the copy's own hold
    restore_kernels(clone)
    assert modeling_llama.apply_rotary_pos_emb is STOCK_ROPE


@pytest.mark.slow  # over 2 s: a model saved, loaded and run, interpreted
@pytest.mark.parametrize("how", ["torch.save", "multiprocessing"])
def test_a_pickled_and_loaded_swapped_model_runs_the_kernels_its_report_lists(released, how):
    stock, twin = pair("llama")
    swap_kernels(twin)
    batch = padded_batch()
    if how == "torch.save":
        buffer = io.BytesIO()
        torch.save(twin, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
    else:
        loaded = ForkingPickler.loads(ForkingPickler.dumps(twin))
    assert loaded is not twin
    out, counted = launches(loaded, batch)
    _, want = launches(twin, batch)
    assert counted == want and all(counted.get(KERNELS[op]) for op in KERNELS), counted
    assert report(loaded).short() == report(twin).short()
    assert rel(out.loss, stock(**batch).loss) <= 1e-5
    with torch.no_grad():
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
        assert rel(loaded.eval()(**inputs).logits, stock.eval()(**inputs).logits) <= 1e-5
    loaded.train()
    norm = loaded.model.layers[0].input_layernorm
    assert norm.forward.__self__ is norm  # bound to the loaded module, not the saved one
    assert loaded.state_dict().keys() == stock.state_dict().keys()  # checkpoints as stock's
    assert all(torch.equal(v, stock.state_dict()[k]) for k, v in loaded.state_dict().items())
    assert rope.interceptions.held() == {ROPE_GLOBAL: 2}  # the loaded model holds its own
    del twin
    gc.collect()
    _, after = launches(loaded, batch)
    assert after == counted
    assert restore_kernels(loaded) is True
    assert not any(sites.is_swapped(m) for m in loaded.modules())
    assert modeling_llama.apply_rotary_pos_emb is STOCK_ROPE


@pytest.mark.slow
def test_a_model_collected_while_another_compiles_leaves_that_compile_alone(released):
    """The other model dies between the trace of a bystander (which called the RoPE global as a
    pass-through) and the guards built on it: the compile must not see the global change."""
    torch._dynamo.reset()
    holder = [build("llama")]
    swap_kernels(holder[0])
    bystander = build("llama")
    swap_kernels(bystander, ops="glu")  # a different op set: no hold of its own on the RoPE global
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        holder.clear()
        gc.collect()  # the other model is collected after the trace, before the guards
        return aot_eager(gm, example_inputs)

    batch = padded_batch()
    want = bystander(**batch).loss
    got = torch.compile(bystander, backend=backend)(**batch).loss
    assert not holder and rel(got, want) <= 1e-5
    swap_kernels(build("llama"), ops="rms_norm")  # the next swap puts back what nobody holds
    assert modeling_llama.apply_rotary_pos_emb is STOCK_ROPE
    torch._dynamo.reset()


def test_a_site_keeps_its_own_tables_id_through_pickling_and_one_pickled_before_loads():
    """A site keeps the id of its call table beside it (the count while dynamo traces reads it): a
    pickled site gets its new table's id, never the old one's; a site pickled before the id was
    kept (its table in `calls`) loads with that table. Red when `__setstate__` keeps the old id
    or expects the new form only."""
    import pickle

    site = rope.Site(sites.CallTable({"rope": {"fused": 1}}), "apply_rotary_pos_emb")
    back = pickle.loads(pickle.dumps(site))
    assert back.calls == {"rope": {"fused": 1}} and back.calls is not site.calls
    assert back.calls_id == id(back.calls) != site.calls_id
    older = object.__new__(rope.Site)
    older.__setstate__({"calls": {"rope": {"fused": 3}}, "name": "apply_rotary_pos_emb"})
    assert older.calls == {"rope": {"fused": 3}} and older.calls_id == id(older.calls) and older.name
