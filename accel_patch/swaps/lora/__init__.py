"""Fused LoRA: a gated MLP, the q/k/v projections and the output projection whose layers are PEFT
LoRA layers, each computed as one autograd function with a backward derived by hand.

    y = x W^T (+ b) + s (x A^T) B^T          every projection (W plain, or bitsandbytes 4-bit)
    out = down(act(gate(x)) * up(x))         the MLP: saves x, gate and up, nothing else

Sites (found by structure, proved by a probe, per instance and reversible like every swap):

- `lora_mlp`: a gated MLP (mlp.candidate: split gate/up/down or fused gate_up, SiLU or GELU).
  Its forward becomes the `mlp` op: the base matmuls stay torch, each adapter's small
  matmuls are `addmm_`-ed into the base result, the activation is computed as the forward beneath
  computes it with the adapters off (accel_kernels' GLU where the `glu` kernel runs beneath, else the
  module's own formula), so PEFT's reference pass equals a fresh adapter's bit for bit, and backward
  recomputes `act(gate) * up` for the down adapter instead of saving it. A 4-bit base weight is dequantized by bitsandbytes' own `dequantize_4bit` in forward and
  again in backward; nothing dequantized is kept between them.
- `lora_qkv`: the input projections of an attention block (q/k/v with any subset adapted and
  GQA widths, or one fused qkv). The attention's own forward still runs; for that call the
  projections are served from its `_modules` (sites._Served) so that the first one called
  computes all of them from x in one `linears` op (x read and saved once) and the others return
  their share; the projections themselves are never written.
- `lora_o`: the attention's output projection, the same function with one projection.

Decided at every call, so the swap may come before or after `get_peft_model`, and an adapter
added, removed, disabled, merged or switched later is seen at the next call. What the fused
path cannot reproduce runs PEFT's own forward for that call and is counted (`SwapState.calls`,
`SwapReport.calls`): a LoRA variant (DoRA), more than one active adapter, `lora_bias`,
`fan_in_fan_out`, 8-bit or other quantized bases, dtype combinations PEFT does not make (float64
under autocast, adapters of another dtype outside autocast), a trainable base weight, hooks on a
projection (its base layer or adapter included: the fused functions do not call those modules), extra arguments. Autocast (bf16/fp16, PEFT's float32 adapters) and LoRA dropout are
computed: the functions are custom ops (`accel_patch_lora::linears`, `::mlp`) that take the
autocast dtype captured at the call and the dropout masks drawn as PEFT draws them (functions.py). A call with no active adapter
runs what was there before (the `glu` kernel forward when that op was swapped too, else stock).
A decode step (at most `sites.DECODE_ROWS` tokens without grad: generation) runs PEFT's forward,
faster there, counted. On a CUDA device the first call of each call shape times the fused function
against PEFT's forward and that shape runs the faster, counted (timing.py; ACCEL_PATCH_LORA_PATH=fused
keeps every call fused, untimed).

Under torch.compile the sites are traced with the model (sites.py): no graph break, the fused ops
in the graph, the plan's reads as guards; a call is counted once per trace, as "compiled: <outcome>"
(the compiled graph decides for every call it runs).

Which wins with `glu`: both install on the MLP; `lora_mlp` sits on top and runs its fused
function whenever an adapter is active, and the `glu` forward beneath it otherwise. Ask for
`glu`/`rope` in the same call as (or before) the LoRA ops: a module already carrying a LoRA
forward is not swapped again.

One file per job: plans.py (which calls the fused path computes; candidates), functions.py (the
math and its autograd), probe.py (verification at swap time), sites.py (the swapped forwards),
timing.py (fused or PEFT's forward, timed per call shape).
These modules import the shared machinery of swaps/ (sites, probe, report, families) and
layers/mlp.py (the GLU its MLP builds on), never the loss's room.
"""
from .functions import fused_linears, fused_mlp
from .plans import MLP_OP, O_OP, OPS, QKV_OP, attention_candidate, mlp_candidate, structure
from .probe import probe_linears, probe_mlp
from .sites import (COMPILED, DECODE_ROWS, FUSED, IN_SUBGRAPH, INNER_ATTR, NO_ADAPTER, SITE_ATTR, Site, attention_forward,
                    install, mlp_forward, op_of, waiting_ops)
