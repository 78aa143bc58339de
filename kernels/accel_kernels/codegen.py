"""GPU code generation checked without a GPU: every Triton launch the ops' host code makes at real
model shapes, compiled ahead of time for sm_80 and sm_90a, within register, spill and shared-memory
budgets.

    python -m accel_kernels.codegen [--quick] [--json] [--kernels _layer_norm]

How: the host functions of each op (`_forward_triton`, `_backward_triton`, the fused loss's
`_chunked_pass`) run on meta tensors that carry the real shapes, strides and dtypes of a model's
layers (`MODELS`, written as data), inside `_launch.capturing()`, which records every launch
(kernel, grid, arguments, meta) instead of running it. Each launch is specialized the way
Triton's JIT specializes it at run time (its own binder where the installed triton has one: the
16-byte divisibility of pointers and ints, ints equal to 1), with stand-in pointers whose
addresses are those of a fresh CUDA allocation plus the tensor's storage offset. Distinct
configurations (kernel, signature, constants, attributes, options, target) are compiled once each
with `triton.compile(ASTSource(...), target=GPUTarget("cuda", 80 | 90, 32))`, on all CPU cores; the
bundled ptxas runs `-v` on the PTX for registers and spills, `metadata.shared` gives shared memory.

A configuration fails on a compile error, more registers a thread than its num_warps leaves
(65536 a SM / (32 * num_warps), at most 255), shared memory over the device's limit a block
(sm_80: 163 KiB, sm_90: 227 KiB), or a spill of more than SPILL_LIMIT bytes (smaller spills are
reported). Occupancy is the number of blocks a SM holds by registers, shared memory, threads and
the block limit.

`run(quick)` returns the records, `table(records)` renders them. Under Triton's CPU interpreter
(the kernels then are interpreter functions, which cannot be compiled) `run` does its work in a
fresh process without TRITON_INTERPRET.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

from . import _launch, _triton

# --------------------------------------------------------------------------------------------
# What is checked: model shapes (from the models' config.json) and the targets
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Model:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int
    activation: str  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    norm: tuple[str, float]  # (casting, offset) of its RMSNorm
    softcap: float | None = None  # final-logit soft-capping
    qk_norm: bool = False  # RMSNorm over each head of q and k
    rotary_dim: int | None = None  # partial rotary (None: the whole head)
    # other norms over heads: (heads, width, weighted, activation, casting); a weightless one (Llama 4's
    # q/k L2 norm) or a gated one, norm(x) * act(gate) (the linear-attention output norms) or
    # norm(x * silu(gate)) ("pre_silu": Mamba2's)
    norm_forms: tuple = ()


MODELS = {
    "Llama-3-8B": Model(4096, 32, 8, 128, 128256, 14336, "silu", ("llama", 0.0)),
    "Gemma-2-9B": Model(3584, 16, 8, 256, 256000, 14336, "gelu_tanh", ("gemma", 1.0), softcap=30.0),
    "Qwen2.5-7B": Model(3584, 28, 4, 128, 152064, 18944, "silu", ("llama", 0.0)),
    "Llama-3-70B": Model(8192, 64, 8, 128, 128256, 28672, "silu", ("llama", 0.0)),
    # the ends of the ranges: hidden 2048 with head dim 64, vocabulary 32k, vocabulary 262k with
    # q/k norms, partial rotary
    "Llama-3.2-1B": Model(2048, 32, 8, 64, 128256, 8192, "silu", ("llama", 0.0)),
    "Mistral-7B-v0.1": Model(4096, 32, 8, 128, 32000, 14336, "silu", ("llama", 0.0)),
    "Gemma-3-4B": Model(2560, 8, 4, 256, 262208, 10240, "gelu_tanh", ("gemma", 1.0), qk_norm=True),
    "Phi-4-mini": Model(3072, 24, 8, 128, 200064, 8192, "silu", ("llama", 0.0), rotary_dim=96),
    # hidden 16384: rows wider than one block (rms_norm's separate dot pass)
    "Llama-3.1-405B": Model(16384, 128, 8, 128, 128256, 53248, "silu", ("llama", 0.0)),
    # the weightless and gated norms (their configs' defaults in transformers)
    "Llama-4-Scout": Model(5120, 40, 8, 128, 202048, 16384, "silu", ("llama", 0.0),
                           norm_forms=((40, 128, False, "", "gemma"),)),
    "Qwen3-Next-80B-A3B": Model(2048, 16, 2, 256, 151936, 5632, "silu", ("gemma", 1.0), qk_norm=True, rotary_dim=64,
                                norm_forms=((32, 128, True, "silu", "llama"),)),
    "Kimi-Linear-48B-A3B": Model(2304, 32, 32, 64, 163840, 9216, "silu", ("llama", 0.0),
                                 norm_forms=((32, 128, True, "sigmoid", "gemma"),)),
    # Mamba2's gated norm, the gate before normalizing, one group over d_inner = 2 * hidden
    "Granite-4.0-H": Model(4096, 32, 32, 128, 32000, 1024, "silu", ("llama", 0.0),
                           norm_forms=((1, 8192, True, "pre_silu", "llama"),)),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# tokens of one step: a sequence of 4096, and for bf16 (what fine-tuning runs in) also 8191: a
# count that no power of two divides changes what the compiler may assume about the ints
TOKENS = {"bf16": (4096, 8191), "fp16": (4096,), "fp32": (4096,)}



@dataclasses.dataclass(frozen=True)
class MoeModel:
    """The experts of a MoE layer (moe_experts), from the model's config.json."""
    hidden: int
    intermediate: int  # of one expert (moe_intermediate_size)
    experts: int
    top_k: int
    activation: str = "silu"
    transposed: bool = False  # gate_up [E, H, 2I] used as x @ w (gpt-oss)
    interleaved: bool = False  # gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    bias: bool = False
    limit: float = float("inf")  # the clamped SwiGLU's bound (DeepSeek V4, GLM-5-next); gpt-oss's is 7


MOE_MODELS = {
    "Qwen3-30B-A3B": MoeModel(2048, 768, 128, 8),
    "gpt-oss-20b": MoeModel(2880, 2880, 32, 4, "gpt_oss", transposed=True, interleaved=True, bias=True),
    "Mixtral-8x7B": MoeModel(4096, 14336, 8, 2),
    "DeepSeek-V2-Lite": MoeModel(2048, 1408, 64, 6),  # DeepSeek-V3's experts at a lite size
    "DeepSeek-V4": MoeModel(4096, 2048, 256, 6, limit=10.0),  # the clamped SwiGLU at its config's defaults
}
# a training step and one decoded token (a tile list mostly of experts without rows)
MOE_TOKENS = (4096, 1)
MOE_DTYPES = ("bf16", "fp32")
MOE_LORA_RANK = 16

#: LayerNorms with a weight and a bias (layer_norm), by their width: rows = tokens of a step.
LAYER_NORM_MODELS = {
    "DeepSeek-V3.2": 128,  # the DSA indexer's k_norm over index_head_dim (GLM-MoE-DSA, GLM-5-next, Mistral Large 4 alike)
    "GPT-NeoX-20B": 6144,  # the decoder's norms over the hidden width
    "BLOOM-176B": 14336,  # rows wider than one block (layer_norm's separate dot pass)
}

QUICK_MODELS = ("Llama-3-8B", "Gemma-2-9B")
QUICK_LAYER_NORM_MODELS = ("DeepSeek-V3.2",)
QUICK_MOE_MODELS = ("Qwen3-30B-A3B",)  # at QUICK_TOKENS, without LoRA
QUICK_DTYPES = ("bf16",)
QUICK_TOKENS = (4096,)


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    capability: int
    sms: int  # of the GPU the host code is sized for (A100, H100)
    shared_per_block: int
    shared_per_sm: int


TARGETS = {
    "sm_80": Target("sm_80", 80, 108, 163 * 1024, 164 * 1024),
    "sm_90": Target("sm_90", 90, 132, 227 * 1024, 228 * 1024),
}
REGISTERS_PER_SM = 65536
MAX_THREADS_PER_SM = 2048
MAX_BLOCKS_PER_SM = 32
SPILL_LIMIT = 64  # bytes of spill stores a thread

# --------------------------------------------------------------------------------------------
# Capture: the host code on meta tensors
# --------------------------------------------------------------------------------------------


def _meta(shape, dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


@contextlib.contextmanager
def _sized_for(target: Target):
    """The host code as it sizes grids and tiles on `target` (it asks torch.cuda for the SM count
    and the shared memory a block may use)."""
    from .ops import layer_norm, moe_experts, rms_norm

    modules = (rms_norm, layer_norm)
    real = [m._max_programs for m in modules]
    real_shared = moe_experts._shared_memory
    moe_experts._shared_memory = lambda device: target.shared_per_block

    def sized(module):
        def max_programs(device, num_warps):
            return max(1, REGISTERS_PER_SM // (32 * num_warps * module._BWD_REGISTERS)) * target.sms
        return max_programs

    for module in modules:
        module._max_programs = sized(module)
    try:
        yield
    finally:
        for module, fn in zip(modules, real):
            module._max_programs = fn
        moe_experts._shared_memory = real_shared


def _drive(model: Model, dtype: torch.dtype, tokens: int, rope_forms=None):
    """Run every op's host functions, forward and backward, at the model's shapes (meta tensors);
    RoPE in `rope_forms` (indices into rope.FORMS; None: all)."""
    from .ops import _glu, cross_entropy, fused_linear_cross_entropy, relu_squared, rms_norm, rope

    casting, offset = model.norm
    norms = [(tokens, model.hidden)] + ([(tokens * model.heads, model.head_dim)] if model.qk_norm else [])
    for shape in norms:
        x, w = _meta(shape, dtype), _meta(shape[-1:], dtype)
        y, saved = rms_norm._forward_triton(x, w, 1e-6, offset, casting)
        for need_w in (True, False):  # trained weight; frozen weight (LoRA)
            rms_norm._backward_triton(torch.empty_like(y), saved, x.shape, 1e-6, offset, casting, True, need_w, None)
    for heads, width, weighted, activation, casting in model.norm_forms:
        x = _meta((tokens * heads, width), dtype)
        w = _meta((width,), dtype) if weighted else None
        gate = _meta((tokens * heads, width), dtype) if activation else None
        y, saved = rms_norm._forward_triton(x, w, 1e-6, 0.0, casting, gate, activation)
        rms_norm._backward_triton(torch.empty_like(y), saved, x.shape, 1e-6, 0.0, casting, True, weighted, None,
                                  activation, gate is not None)
    # q, k as attention makes them: (B, S, H, D) projections viewed as (B, H, S, D)
    q = _meta((1, tokens, model.heads, model.head_dim), dtype).transpose(1, 2)
    k = _meta((1, tokens, model.kv_heads, model.head_dim), dtype).transpose(1, 2)
    rot = model.rotary_dim or model.head_dim
    cos, sin = _meta((1, tokens, rot), dtype), _meta((1, tokens, rot), dtype)
    for form in range(len(rope.FORMS)) if rope_forms is None else rope_forms:
        q_out, k_out = rope._forward_triton(q, k, cos, sin, 1, form)
        rope._backward_triton(torch.empty_like(q_out), torch.empty_like(k_out), None, None, cos, sin, 1, q.dtype,
                              k.dtype, (True, True, False, False), None, form)
    gate, up = _meta((tokens, model.intermediate), dtype), _meta((tokens, model.intermediate), dtype)
    act = _glu.ACTIVATIONS[model.activation]
    _glu._forward_triton(gate, up, act)
    _glu._backward_triton(torch.empty_like(gate), gate, up, act)
    if act == _glu.SILU:  # the clamped variant (DeepSeek V4's and GLM-5-next's swiglu_limit): same shapes
        _glu._forward_triton(gate, up, act, 10.0)
        _glu._backward_triton(torch.empty_like(gate), gate, up, act, 10.0)
    # the halves of a fused gate_up projection (Phi3's), read in place by the row kernels
    first, second = _meta((tokens, 2 * model.intermediate), dtype).chunk(2, dim=-1)
    _glu._forward_triton(first, second, act)
    _glu._backward_triton(torch.empty_like(gate), first, second, act)
    relu_squared._forward_triton(up)  # Nemotron-H's non-gated MLP: the same elementwise shapes
    relu_squared._backward_triton(torch.empty_like(up), up)
    labels = _meta((tokens,), torch.int64)
    loss, lse = _meta((tokens,), torch.float32), _meta((tokens, 2), torch.float32)
    logits = _meta((1, tokens + 1, model.vocab), dtype)[:, :-1]  # shifted logits: two row strides
    cross_entropy._forward_triton(logits, labels, -100, model.softcap, loss, lse)
    grad = _meta((tokens, model.vocab), dtype)
    cross_entropy._backward_triton(logits, labels, -100, model.softcap, lse, _meta((1,), torch.float32), grad)
    h, w = _meta((tokens, model.hidden), dtype), _meta((model.vocab, model.hidden), dtype)
    rows = fused_linear_cross_entropy.chunk_rows(tokens, model.vocab, h.element_size(),
                                                 fused_linear_cross_entropy.CHUNK_BYTES)
    scale = _meta((1,), torch.float32)
    for mode in ({"loss": loss, "lse": lse}, {"saved_lse": lse}):  # "mean"/"sum"; "none"'s backward
        fused_linear_cross_entropy._chunked_pass(h, w, None, labels, -100, model.softcap, True, rows, scale=scale,
                                                 need_h=True, need_w=True, need_b=False, **mode)


def _drive_layer_norm(width: int, dtype: torch.dtype, tokens: int):
    """layer_norm's host functions over (tokens, width), weight and bias in x's dtype, forward and
    backward: trained weight and bias, and frozen ones (LoRA)."""
    from .ops import layer_norm

    x, w, b = _meta((tokens, width), dtype), _meta((width,), dtype), _meta((width,), dtype)
    y, saved = layer_norm._forward_triton(x, w, b, 1e-6)
    for need in (True, False):
        layer_norm._backward_triton(torch.empty_like(y), saved, x.shape, 1e-6, True, need, need)


def _drive_moe(model: MoeModel, dtype: torch.dtype, tokens: int, lora: bool = True):
    """moe_experts' host functions at the model's shapes (meta tensors): full fine-tuning (every
    weight's gradient) and, with lora, split LoRA of rank MOE_LORA_RANK on PEFT's strided views
    with float32 adapters under autocast to `dtype` (the base frozen), and for a half `dtype` a
    full fine-tune of float32 weights and activations under autocast to it; forward and backward."""
    from .ops import moe_experts

    E, H, I, K = model.experts, model.hidden, model.intermediate, model.top_k
    gate_up = _meta((E, H, 2 * I) if model.transposed else (E, 2 * I, H), dtype)
    down = _meta((E, I, H) if model.transposed else (E, H, I), dtype)
    biases = (_meta((E, 2 * I), dtype), _meta((E, H), dtype)) if model.bias else (None, None)
    order, offsets = moe_experts._route(_meta((tokens, K), torch.int64), E)
    hidden, weights, grad = _meta((tokens, H), dtype), _meta((tokens, K), dtype), _meta((tokens, H), dtype)
    act = moe_experts.ACTIVATIONS[model.activation]
    r = MOE_LORA_RANK
    adapters = _meta((r * E, H), torch.float32).view(E, r, H), _meta((2 * I, r, E), torch.float32).permute(2, 0, 1), \
        _meta((r * E, I), torch.float32).view(E, r, I), _meta((H, r, E), torch.float32).permute(2, 0, 1)
    full, peft = (True,) * 6 + (False,) * 4, (True, True) + (False,) * 4 + (True,) * 4
    variants = [(None, full, None)] + [(adapters, peft, None)] * lora
    if lora and dtype != torch.float32:  # a full fine-tune of fp32 weights under autocast: 4-byte operands
        variants.append((None, full, torch.float32))
    for adapter, needs, master in variants:
        tensors = (gate_up, down, *biases, hidden, grad)
        if master is not None:
            tensors = tuple(_meta(t.shape, master) if t is not None else None for t in tensors)
        *weights_and_biases, x, g = tensors
        params = moe_experts._Params(*weights_and_biases, *(adapter or (None,) * 4), 2.0, 2.0, model.transposed,
                                     model.interleaved, act, 1.702, 7.0 if model.activation == "gpt_oss" else model.limit,
                                     dtype)
        moe_experts._forward(x, weights, order, offsets, params, moe_experts._TritonOps)
        moe_experts._backward(g, x, weights, order, offsets, params, needs, moe_experts._TritonOps)


def _shape_of(launch: _launch.Launch) -> str:
    shapes = [tuple(a.shape) for a in launch.args if isinstance(a, torch.Tensor)]
    return "x".join(map(str, shapes[0])) if shapes else ""


# --------------------------------------------------------------------------------------------
# Specialization: what Triton's JIT would compile for a launch
# --------------------------------------------------------------------------------------------


class _Pointer:
    """A stand-in for a CUDA tensor argument: its dtype and an address (a fresh allocation is
    512-byte aligned; a view starts storage_offset elements further)."""

    def __init__(self, t: torch.Tensor):
        self.dtype = t.dtype
        self._address = (1 << 32) + t.storage_offset() * t.element_size()

    def data_ptr(self) -> int:
        return self._address


def _jit_function(kernel):
    return kernel  # a triton JITFunction (kernels are not interpreter functions here)


def _specialize(kernel, args, meta, backend):
    """(signature, constexprs, attrs, options) as the installed triton's JIT makes them."""
    args = [_Pointer(a) if isinstance(a, torch.Tensor) else a for a in args]
    try:  # triton >= 3.4: the JIT's own binder and packer
        from triton.runtime.jit import create_function_from_signature

        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, specialization, options = binder(*args, **meta)
        options, signature, constexprs, attrs = kernel._pack_args(backend, meta, bound, specialization, options)
        return signature, constexprs, attrs, options
    except (ImportError, AttributeError, TypeError):
        return _specialize_by_rule(kernel, args, meta, backend)


def _specialize_by_rule(kernel, args, meta, backend):
    """The JIT's specialization rules written out, for a triton without the binder API: pointers
    and ints divisible by 16 get tt.divisibility 16, ints equal to 1 become constants, floats and
    bools are not specialized (no attribute), constants get an empty one."""
    names = kernel.arg_names
    values = dict(zip(names, args))
    values.update({k: v for k, v in meta.items() if k in names})
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(names, kernel.params)):
        value = values[name]
        if param.is_constexpr or (type(value) is int and value == 1 and not param.do_not_specialize):
            signature[name], constexprs[(i,)], attrs[(i,)] = "constexpr", value, []
            continue
        if isinstance(value, _Pointer):
            signature[name] = "*" + _TYPE_NAMES[value.dtype]
            divisible = value.data_ptr() % 16 == 0
        elif isinstance(value, bool):
            signature[name] = "u1"
            continue
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            divisible = value % 16 == 0 and not param.do_not_specialize
        elif isinstance(value, float):
            signature[name] = "fp32"
            continue
        else:
            raise TypeError(f"{kernel.__name__}: argument {name} of type {type(value).__name__}")
        attrs[(i,)] = [["tt.divisibility", 16]] if divisible else []
    options = backend.parse_options({k: v for k, v in meta.items() if k not in names})
    return signature, constexprs, attrs, options


def specialization_key(signature, constexprs, attrs):
    """What a specialization means to the compiler: an empty attribute list specializes nothing, so
    an argument listed with [] and one left out are the same one (triton 3.9's binder lists every
    constant with [], 3.6's leaves them out, the rule above lists them)."""
    return signature, constexprs, {k: v for k, v in attrs.items() if v}


_TYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
               torch.int32: "i32"}


# --------------------------------------------------------------------------------------------
# Compile and measure (in worker processes: one configuration a call)
# --------------------------------------------------------------------------------------------


def _ptxas(capability: int) -> str:
    from triton.backends.nvidia import compiler as nvidia

    try:
        return nvidia.get_ptxas(capability).path  # triton 3.9
    except TypeError:
        return nvidia.get_ptxas().path  # triton 3.6: one ptxas


def _gpu_name(capability: int) -> str:
    return "sm_90a" if capability == 90 else f"sm_{capability}"


def _compile(job) -> dict:
    """Compile one configuration; registers, spills, shared memory or the error."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name, signature, constexprs, attrs, options, capability = job
    kernel = getattr(importlib.import_module(module), name)
    printed = io.StringIO()
    try:
        source = ASTSource(kernel, signature, constexprs, attrs)
        with contextlib.redirect_stdout(printed), _ptxas_log_printed():
            compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
    except Exception as error:  # a configuration that does not compile is a finding, not a crash
        return {"error": f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:300]}"}
    log = printed.getvalue()
    if "Used" not in log:  # from triton's cache (no ptxas ran), or a triton without the knob
        log = _ptxas_log(compiled.asm["ptx"], capability)
    if log is None:
        return {"error": "ptxas -v failed"}
    registers = re.search(r"Used (\d+) registers", log)
    stores = re.search(r"(\d+) bytes spill stores", log)
    loads = re.search(r"(\d+) bytes spill loads", log)
    return {"registers": int(registers.group(1)) if registers else None,
            "spill_stores": int(stores.group(1)) if stores else 0,
            "spill_loads": int(loads.group(1)) if loads else 0,
            "shared": int(compiled.metadata.shared)}


@contextlib.contextmanager
def _ptxas_log_printed():
    """triton prints the log of its own `ptxas -v` run (triton 3.9's knob; elsewhere nothing)."""
    try:
        from triton import knobs

        nvidia = knobs.nvidia
        before = nvidia.dump_ptxas_log
    except (ImportError, AttributeError):
        yield
        return
    nvidia.dump_ptxas_log = True
    try:
        yield
    finally:
        nvidia.dump_ptxas_log = before


def _ptxas_log(ptx_source: str, capability: int) -> str | None:
    """`ptxas -v` on the PTX, with the options triton compiles it with; None if ptxas fails."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(ptx_source)
        proc = subprocess.run([_ptxas(capability), "-v", "-lineinfo", "--regAllocOptLevel=2",
                               f"--gpu-name={_gpu_name(capability)}", ptx, "-o", os.path.join(tmp, "kernel.cubin")],
                              capture_output=True, text=True)
    return None if proc.returncode else proc.stderr + proc.stdout


def register_budget(num_warps: int) -> int:
    """The most registers a thread may use for a block of num_warps to fit a SM at all."""
    return min(255, REGISTERS_PER_SM // (32 * num_warps))


def blocks_per_sm(registers: int, shared: int, num_warps: int, target: Target) -> int:
    """Blocks of num_warps resident on one SM, by registers (allocated per warp in units of 256),
    shared memory, threads and the block limit."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = (REGISTERS_PER_SM // per_warp) // num_warps if per_warp else MAX_BLOCKS_PER_SM
    by_shared = target.shared_per_sm // shared if shared else MAX_BLOCKS_PER_SM
    by_threads = MAX_THREADS_PER_SM // (32 * num_warps)
    return min(by_registers, by_shared, by_threads, MAX_BLOCKS_PER_SM)


def _judge(record: dict, target: Target) -> dict:
    problems = []
    if "error" in record:
        problems.append(f"compile error: {record['error']}")
    else:
        budget = register_budget(record["num_warps"])
        if record["registers"] is None or record["registers"] > budget:
            problems.append(f"{record['registers']} registers > {budget} at {record['num_warps']} warps")
        if record["shared"] > target.shared_per_block:
            problems.append(f"shared {record['shared']} B > {target.shared_per_block} B")
        if record["spill_stores"] > SPILL_LIMIT:
            problems.append(f"spills {record['spill_stores']} B > {SPILL_LIMIT} B")
        record["blocks_per_sm"] = blocks_per_sm(record["registers"] or 255, record["shared"], record["num_warps"],
                                                target)
    record["ok"] = not problems
    record["problems"] = problems
    return record


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def _configurations(quick: bool) -> dict:
    """key -> record skeleton for every distinct configuration the host code launches."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    models = QUICK_MODELS if quick else tuple(MODELS)
    dtypes = QUICK_DTYPES if quick else tuple(DTYPES)
    found: dict = {}
    for target in TARGETS.values():
        backend = make_backend(GPUTarget("cuda", target.capability, 32))
        for model_name in models:
            for dtype_name in dtypes:
                for tokens in QUICK_TOKENS if quick else TOKENS[dtype_name]:
                    with _sized_for(target), _launch.capturing() as launches:
                        # RoPE's interleaved forms differ from rotate-half only in addressing: compiled at the
                        # quick models' shapes (every dtype and token count), which keeps the matrix's time
                        _drive(MODELS[model_name], DTYPES[dtype_name], tokens,
                               rope_forms=None if model_name in QUICK_MODELS else (0,))
                    _add_launches(found, launches, backend, target, f"{model_name}/{dtype_name}/{tokens}")
        for model_name in QUICK_LAYER_NORM_MODELS if quick else tuple(LAYER_NORM_MODELS):
            for dtype_name in dtypes:
                for tokens in QUICK_TOKENS if quick else TOKENS[dtype_name]:
                    with _sized_for(target), _launch.capturing() as launches:
                        _drive_layer_norm(LAYER_NORM_MODELS[model_name], DTYPES[dtype_name], tokens)
                    _add_launches(found, launches, backend, target, f"{model_name}/{dtype_name}/{tokens}")
        for model_name in QUICK_MOE_MODELS if quick else tuple(MOE_MODELS):
            for dtype_name in QUICK_DTYPES if quick else MOE_DTYPES:
                for tokens in QUICK_TOKENS if quick else MOE_TOKENS:
                    with _sized_for(target), _launch.capturing() as launches:
                        _drive_moe(MOE_MODELS[model_name], DTYPES[dtype_name], tokens, lora=not quick)
                    _add_launches(found, launches, backend, target, f"{model_name}/{dtype_name}/{tokens}")
    return found


def _add_launches(found: dict, launches, backend, target: Target, where: str) -> None:
    """Add each captured launch to `found` under its configuration key, noting `where` it ran."""
    dtype_name = where.split("/")[1]
    for launch in launches:
        kernel = _jit_function(launch.kernel)
        signature, constexprs, attrs, options = _specialize(kernel, launch.args, launch.meta, backend)
        options = {k: v for k, v in options.__dict__.items() if k in ("num_warps", "num_stages", "num_ctas")}
        key = (launch.name, json.dumps(signature, sort_keys=True), repr(sorted(constexprs.items())),
               repr(sorted(attrs.items())), repr(sorted(options.items())), target.name)
        record = found.setdefault(key, {
            "kernel": launch.name, "target": target.name, "dtype": dtype_name,
            "num_warps": options["num_warps"], "num_stages": options.get("num_stages"),
            "constants": {kernel.arg_names[p[0]]: v for p, v in constexprs.items()},
            "shape": _shape_of(launch), "models": [],
            "job": (kernel.fn.__module__, launch.name, signature, constexprs, attrs, options,
                    target.capability),
        })
        if where not in record["models"]:
            record["models"].append(where)


def _run_here(quick: bool, workers: int | None = None, kernels: str | None = None) -> list[dict]:
    if _triton.INTERPRETING or not _triton.AVAILABLE:
        raise RuntimeError("codegen needs triton's compiler: run it without TRITON_INTERPRET=1")
    configurations = [c for c in _configurations(quick).values() if not kernels or c["kernel"].startswith(kernels)]
    workers = workers or os.cpu_count() or 1
    jobs = [c["job"] for c in configurations]
    if workers > 1:
        import multiprocessing

        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            results = list(pool.map(_compile, jobs))
    else:
        results = [_compile(job) for job in jobs]
    records = []
    for config, result in zip(configurations, results):
        record = {k: v for k, v in config.items() if k != "job"}
        record.update(result)
        records.append(_judge(record, TARGETS[record["target"]]))
    records.sort(key=lambda r: (r["kernel"], r["target"], r["dtype"], r["shape"]))
    return records


def run(quick: bool = False, kernels: str | None = None) -> list[dict]:
    """Capture, compile and judge every configuration (a subset of models, dtypes and token
    counts with quick=True; only the kernels whose names start with `kernels`, e.g.
    "_layer_norm", when given). Returns one record a configuration: kernel, target, dtype, shape (of
    its first tensor argument), models (model/dtype/tokens that launch it), num_warps,
    num_stages, constants, registers, spill_stores, spill_loads (bytes), shared (bytes),
    blocks_per_sm, ok, problems (why not ok) or error."""
    if not _triton.INTERPRETING:
        return _run_here(quick, kernels=kernels)
    # the kernels of this process were made for the interpreter: compile in one that has real ones
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "accel_kernels.codegen", "--json"] + (["--quick"] if quick else []) + (
        ["--kernels", kernels] if kernels else [])
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"{' '.join(command)} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def table(records: list[dict]) -> str:
    """One line a configuration: kernel, shape, models, dtype, target, warps, registers, spills,
    shared memory, blocks per SM, and what is wrong, if anything."""
    header = ("kernel", "shape", "models", "dtype", "target", "warps", "regs", "spill B", "shared B", "blocks/SM",
              "verdict")
    rows = [header]
    for r in records:
        models = sorted({m.split("/")[0] for m in r["models"]})
        rows.append((
            r["kernel"], r["shape"], ",".join(models) if len(models) <= 2 else f"{models[0]} +{len(models) - 1}",
            r["dtype"], r["target"], str(r["num_warps"]), str(r.get("registers", "-")),
            f"{r.get('spill_stores', '-')}/{r.get('spill_loads', '-')}", str(r.get("shared", "-")),
            str(r.get("blocks_per_sm", "-")), "ok" if r["ok"] else "FAIL: " + "; ".join(r["problems"]),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    failed = sum(not r["ok"] for r in records)
    lines.append(f"{len(records)} configurations, {failed} failed")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m accel_kernels.codegen", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few models, bf16, one token count")
    parser.add_argument("--json", action="store_true", help="the records as JSON on stdout")
    parser.add_argument("--kernels", help="only the kernels whose names start with this (e.g. _layer_norm)")
    args = parser.parse_args(argv)
    records = run(quick=args.quick, kernels=args.kernels)
    print(json.dumps(records) if args.json else table(records))
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
