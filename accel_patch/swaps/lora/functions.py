"""The fused functions, as custom ops: one for a gated MLP whose projections are LoRA layers, one
for projections reading the same input (q/k/v, or the output projection alone), each with a
backward op derived by hand (2-D math; the adapter tensors come in as (A, B) pairs).

    y = x W^T (+ b) + s (drop(x) A^T) B^T     every projection (W plain, or bitsandbytes 4-bit)
    out = down(act(gate(x)) * up(x))          the MLP: saves x, gate, up and the dropout masks

Ops (namespace `accel_patch_lora`, see _library in accel_kernels for the pattern): `linears`,
`linears_backward`, `mlp`, `mlp_backward`, each with a fake implementation, the forward ones with
a registered autograd formula, so that dynamo sees one node per call (fullgraph) and AOTAutograd
keeps what backward saves as small as eager does; in eager the same functions run through a
torch.autograd.Function (`_EagerLinears`, `_EagerMLP`), without the custom-op boundary's host cost.
Inside an op autocast and autograd are off: the
dtypes of every step come in explicitly (`plans.dtypes`, from the autocast state captured at the
call), and backward replays them. Tensors go in as one flat list and a `spec` string says what
each is (which projection, bias, adapter, dropout mask, 4-bit quant state) and the dtypes; a 4-bit
weight comes as its packed tensor and quant state tensors, dequantized by bitsandbytes' own op
inside, in forward and again in backward, never kept.

Dropout is drawn outside the ops (the ops stay deterministic): for each adapted projection with
p > 0, the RNG call `F.dropout` makes on a tensor of the shape, dtype and device of what PEFT's
dropout sees (`dropout_mask`), in PEFT's order, so the same RNG draws give the same mask; only its
bool form (1 byte/element) goes in and is kept for backward.
"""
from __future__ import annotations

import functools
import math
from collections import namedtuple

import torch
import torch.nn.functional as F

from ..layers import mlp
from .plans import Dtypes, Proj, dtypes


def _first_order() -> None:
    """Call first thing in each fused LoRA backward: they use tensors the forward made with autograd
    off, so a second derivative through them would silently lose the projections' part."""
    from accel_kernels import _dispatch

    _dispatch.check_first_order(
        "accel-patch's fused LoRA", "leave the LoRA ops out for this model (ACCEL_PATCH_KERNELS without "
        "lora_mlp, lora_qkv and lora_o, or restore_kernels(model)) to take second derivatives")


NAMESPACE = "accel_patch_lora"

_DTYPE_CODES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.float64: "f64"}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}


class Meta(namedtuple("Meta", "kind bias adapted scale p dt out_features quant")):
    """A projection as an op reads it from the spec: dt is its `plans.Dtypes`; quant, for a 4-bit
    weight, (shape, blocksize, quant_type, nested state's blocksize or 0)."""

    __slots__ = ()

    @property
    def n_tensors(self) -> int:
        n = 1 + self.bias + 2 * self.adapted + (self.p > 0)
        if self.quant is not None:
            n += 4 if self.quant[3] else 1
        return n


# --------------------------------------------------------------------------------------------
# The spec: what the flat tensor list holds, as one string (a schema-able constant)
# --------------------------------------------------------------------------------------------


def _encode(p: Proj, x_dtype: torch.dtype, adapter_dtype, out_features: int, quant) -> str:
    # once per configuration (a spec item is a few microseconds of string work a projection a call)
    return _encoded(p.kind, p.bias is not None, p.adapted, p.scale, p.dropout, p.compute, p.autocast, p.lora_cast,
                    p.peft_cast, x_dtype, adapter_dtype, out_features, quant)


@functools.lru_cache(maxsize=1024)
def _encoded(kind, bias: bool, adapted: bool, scale, dropout, compute, autocast, lora_cast, peft_cast, x_dtype,
             adapter_dtype, out_features: int, quant) -> str:
    p = Proj(None, None, kind, compute, adapted, scale, dropout, autocast, lora_cast, peft_cast)  # what dtypes reads
    dt = dtypes(p, x_dtype, adapter_dtype)
    codes = ".".join(_DTYPE_CODES[d] for d in dt)
    head = f"{kind},{int(bias)},{int(adapted)},{scale!r},{dropout!r},{codes},{out_features}"
    if quant is None:
        return head
    shape, blocksize, quant_type, nested = quant
    return f"{head},{shape[0]},{shape[1]},{blocksize},{quant_type},{nested}"


@functools.lru_cache(maxsize=256)
def parse(spec: str) -> tuple:
    """(projection Metas, extra fields) from a spec string (`_encode`d projections joined by "|",
    then the op's own fields after ";")."""
    projs, _, extra = spec.partition(";")
    metas = []
    for item in projs.split("|"):
        f = item.split(",")
        dt = Dtypes(*(_CODE_DTYPES[c] for c in f[5].split(".")))
        quant = None if len(f) == 7 else ((int(f[7]), int(f[8])), int(f[9]), f[10], int(f[11]))
        metas.append(Meta(f[0], f[1] == "1", f[2] == "1", float(f[3]), float(f[4]), dt, int(f[6]), quant))
    return tuple(metas), tuple(extra.split(",")) if extra else ()


@functools.lru_cache(maxsize=1024)
def _names(m: Meta) -> tuple[str, ...]:
    """The names of projection m's tensors in the flat list, in order."""
    names = ["weight"] + ["bias"] * m.bias + ["A", "B"] * m.adapted + ["mask"] * (m.p > 0)
    if m.quant is not None:
        names += ["absmax", "absmax2", "code2", "offset"] if m.quant[3] else ["absmax"]
    return tuple(names)


def _split(metas, tensors):
    """Per projection, its dict of tensors (weight, bias, A, B, mask, absmax, absmax2, code2, offset)."""
    out, i = [], 0
    for m in metas:
        names = _names(m)
        out.append(dict(zip(names, tensors[i:i + len(names)])))
        i += len(names)
    return out


def _inputs(x_dtype, p: Proj, adapters, mask):
    """(spec item, tensors) of projection p for an input of x_dtype."""
    A, B = adapters if p.adapted else (None, None)
    w = p.weight
    if p.kind == "4bit":
        qs = w.quant_state
        nested = qs.state2.blocksize if qs.nested else 0
        quant = (tuple(qs.shape), qs.blocksize, qs.quant_type, nested)
        extra = [qs.absmax, qs.state2.absmax, qs.state2.code, qs.offset] if qs.nested else [qs.absmax]
        tensors, out_f = [w.data], qs.shape[0]
    else:
        quant, extra, tensors, out_f = None, [], [w], w.shape[0]
    tensors += [p.bias] * (p.bias is not None) + [A, B] * p.adapted + [mask] * (mask is not None) + extra
    return _encode(p, x_dtype, None if A is None else A.dtype, out_f, quant), tensors


# --------------------------------------------------------------------------------------------
# Math (runs inside the ops: no autograd, no autocast; every dtype explicit)
# --------------------------------------------------------------------------------------------


def base_weight(m: Meta, t: dict) -> torch.Tensor:
    """The base weight in the base matmul's dtype: a 4-bit one dequantized by bitsandbytes' op
    (as its gemm does; a temporary, dropped by the caller after its matmul)."""
    if m.quant is None:
        return _to(t["weight"], m.dt.base)
    shape, blocksize, quant_type, nested = m.quant
    absmax = t["absmax"]
    if nested:
        absmax = torch.ops.bitsandbytes.dequantize_blockwise.default(
            absmax, t["absmax2"], t["code2"], nested, torch.float32) + t["offset"]
    return torch.ops.bitsandbytes.dequantize_4bit.default(t["weight"], absmax, blocksize, quant_type, list(shape), m.dt.base)


#: Device types where F.dropout runs the fused native_dropout kernel (`is_fused_kernel_acceptable`).
_FUSED_DROPOUT = ("cuda", "xpu")
#: Device types whose native_dropout_backward is one kernel (grad * mask * scale in one pass).
_ONE_PASS_DROPOUT_BACKWARD = ("cuda",)


def _f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


def dropout_scale(p: float, dtype: torch.dtype, device_type: str, backward: bool = False) -> float:
    """The factor F.dropout multiplies a kept element by (its backward's when `backward`), as a Python
    float exact in float32: on CPU the noise `ones.div_(1 - p)` computed in the input's dtype; CUDA's
    fused kernel: float32 1/(1-p) of float32 (1-p), its backward 1/(1-p) rounded to float32."""
    return _dropout_scale(p, dtype, device_type in _FUSED_DROPOUT, backward)


@functools.lru_cache(maxsize=256)
def _dropout_scale(p: float, dtype: torch.dtype, fused_kernel: bool, backward: bool) -> float:
    """`dropout_scale`, once per value (keyed by the kernel, not the device type, so that a cached
    value always follows `_FUSED_DROPOUT`)."""
    if fused_kernel:
        return _f32(1.0 / (1.0 - p) if backward else 1.0 / _f32(1.0 - p))
    return _cpu_noise(p, dtype)


@functools.lru_cache(maxsize=64)
def _cpu_noise(p: float, dtype: torch.dtype) -> float:
    return float(torch.ones((), dtype=dtype).div_(1 - p))


_HALF = (torch.bfloat16, torch.float16)


def _same_rounding(v_dtype, noise_dtype, out_dtype) -> bool:
    """Whether `v * noise` computed in v's dtype and stored in out_dtype equals PEFT's: v cast to
    noise_dtype, multiplied there, cast to out_dtype. True when v is in noise_dtype already (the
    store casts as `.to` does), and when v is half precision, the noise float32 and the result cast
    back to v's dtype: half-precision arithmetic computes in float32 and rounds once to half, which
    is float32's rounding followed by the cast."""
    return v_dtype == noise_dtype or (v_dtype in _HALF and noise_dtype == torch.float32 and out_dtype == v_dtype)


def dropped(v: torch.Tensor, mask: torch.Tensor | None, p: float, noise_dtype: torch.dtype,
            out_dtype: torch.dtype, backward: bool = False, casts: dict | None = None) -> torch.Tensor:
    """PEFT's `dropout(v.to(noise_dtype)).to(out_dtype)` (or the same for dropout's backward), bit for
    bit as F.dropout computes it, in as few passes as that allows: the mask multiply (exact in any
    dtype) and the scale in v's own dtype where the rounding is the same (`_same_rounding`: no
    float32 copy of a half-precision v), the cast to out_dtype taken by the scale's store. Without a
    mask: v itself where the casts are a round trip (half -> float32 -> half)."""
    same = _same_rounding(v.dtype, noise_dtype, out_dtype)
    if mask is None:
        return _as(v, out_dtype, casts) if same else _as(v, noise_dtype, casts).to(out_dtype)
    if mask.shape != v.shape:  # `dropout_mask` draws it 2-D already: no reshape a call
        mask = mask.reshape(v.shape)
    device_type = v.device.type
    scale = dropout_scale(p, noise_dtype, device_type, backward)
    # v * mask * scale in one pass, rounded once, where the result is in the dtype the op reads and
    # the device runs dropout's own backward op as one kernel (CUDA's computes in float32 and rounds
    # to v's dtype, as the scale's multiply does; CPU's casts the mask and multiplies twice: slower
    # than the multiplies below): v in its own dtype where the rounding is the same, else cast to the
    # noise's dtype when that is the result's (PEFT's dropout output itself: one pass a projection,
    # less than a shared x * scale and a mask multiply each)
    if device_type in _ONE_PASS_DROPOUT_BACKWARD:
        if same and out_dtype == v.dtype:
            return torch.ops.aten.native_dropout_backward(v, mask, scale)
        if out_dtype == noise_dtype:
            return torch.ops.aten.native_dropout_backward(_as(v, noise_dtype, casts), mask, scale)
    if casts is not None:
        # projections reading the same x: fp32(x * scale) once (rounded to out_dtype), then one exact
        # mask multiply each ((x * s) * 0/1 is (x * 0/1) * s, signed zeros and NaNs included as s > 0;
        # not where x * s overflows, within a factor 1/(1-p) of the dtype's largest value)
        key = ("scaled", noise_dtype, out_dtype, scale)
        if key not in casts:
            casts[key] = _scaled(v if same else _as(v, noise_dtype, casts), scale, out_dtype)
        return casts[key] * mask
    t = (v if same else v.to(noise_dtype)) * mask
    return _scaled(t, scale, out_dtype, inplace=True)


def _scaled(t: torch.Tensor, scale: float, out_dtype: torch.dtype, inplace: bool = False) -> torch.Tensor:
    """t * scale computed in t's dtype, stored in out_dtype (in place where t may be overwritten)."""
    if t.dtype == out_dtype:
        return t.mul_(scale) if inplace else t * scale
    return torch.mul(t, scale, out=torch.empty_like(t, dtype=out_dtype))


def _as(x: torch.Tensor, dtype: torch.dtype, casts: dict | None) -> torch.Tensor:
    """x in dtype, cast once per op call for all the projections reading it (`casts`)."""
    if x.dtype == dtype or casts is None:
        return _to(x, dtype)
    if dtype not in casts:
        casts[dtype] = x.to(dtype)
    return casts[dtype]


def _accumulate(dx, term: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dx + term in dtype (term first cast to dtype, as autograd casts each branch's gradient; the
    cast is skipped where exact)."""
    if dx is None:
        return _to(term, dtype)
    return dx.add_(term if torch.promote_types(term.dtype, dtype) == dtype else term.to(dtype))


def _adapter_input(x: torch.Tensor, m: Meta, mask, casts: dict | None) -> torch.Tensor:
    """What lora_A multiplies: x cast to the adapter's input dtype, dropped, cast to its matmul dtype."""
    return dropped(x, mask, m.p, m.dt.lora_in, m.dt.lora, casts=casts)


@functools.lru_cache(maxsize=256)
def _power_of_two(scale: float) -> bool:
    """Whether multiplying by `scale` is exact (a power of two: no rounding but past the dtype's
    range), so that it may move across a matmul, (s g) B = s (g B), without changing a bit."""
    return scale > 0 and math.frexp(scale)[0] == 0.5


def _folded(scale: float, dtype: torch.dtype) -> bool:
    """Whether `scale` may multiply the r-wide x A^T instead of the output-wide product: a power of
    two >= 1 (an exact multiply, and (s x A^T) B^T = s (x A^T B^T) exactly, the matmul's sums scaled
    alike) in a dtype with float32's range (bf16, float32: no overflow the later multiply would not
    have too)."""
    return scale >= 1 and _power_of_two(scale) and dtype in (torch.bfloat16, torch.float32, torch.float64)


def _widens(narrow: torch.dtype, wide: torch.dtype) -> bool:
    """Whether every value of `narrow` is one of `wide` (narrow -> wide -> narrow is the identity)."""
    return torch.promote_types(narrow, wide) == wide


def _to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype: t itself where it is already (no call into torch: the fused functions make dozens
    of such checks a call, and a no-op `.to` costs about a microsecond of host time each)."""
    return t if t.dtype == dtype else t.to(dtype)


#: What `proj_forward` may keep for `proj_backward` (its `kept` dict) so that backward needs neither
#: the adapters' casts nor the r-wide `drop(x) A^T` again: "A", "B" (the adapters in their matmuls'
#: dtype, kept only where that was a cast) and the r-wide product, "xa_s" where it already carries
#: the scale (folded), else "xa". r values a token a projection (16 of 2048 at Llama-3.2-1B's q: under
#: 1% of the saved x) against one matmul and two casts fewer a projection in backward.
KEPT = ("A", "B", "xa", "xa_s", "mask")


@functools.lru_cache(maxsize=1024)
def _kept_product(m: Meta) -> str:
    """The name under which `proj_forward` keeps an adapted projection's r-wide product (and the ops
    return it): "xa_s" where it carries the scale (folded), else "xa"."""
    dt = m.dt
    if dt.lora_in == dt.lora == dt.add == dt.result:
        return "xa"
    return "xa_s" if _folded(m.scale, dt.lora) else "xa"


def _products(metas, keeps) -> list[torch.Tensor]:
    """The kept r-wide products of the adapted projections, in order (the ops' extra outputs)."""
    return [keep[_kept_product(m)] for m, keep in zip(metas, keeps) if m.adapted]


def _kept_dicts(metas, products) -> list | None:
    """`_products`' list back as one kept dict per projection (None when nothing was kept)."""
    if not products:
        return None
    it = iter(products)
    return [{_kept_product(m): next(it)} if m.adapted else {} for m in metas]


class _Draw:
    """In a dropout mask's place: the eager forward draws the mask itself, just before the adapter
    reads its input (`_draw`), in PEFT's order; it is kept for backward as "mask" (KEPT)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "DRAW"


DRAW = _Draw()


def _draw(x: torch.Tensor, m: Meta, casts: dict | None):
    """(what lora_A multiplies, the bool mask), drawn now by the fused dropout kernel F.dropout runs
    on CUDA: on PEFT's dropout input itself (x in the adapter's input dtype, contiguous as PEFT's
    is) where no cast follows the dropout, so that the kernel's output is the adapter's input (its
    values are PEFT's: the same kernel on the same tensor) and no mask multiply is left; else on an
    unwritten tensor of that dtype (the mask is the kernel's RNG draw alone), applied as
    `_adapter_input` applies a mask drawn beforehand."""
    dt = m.dt
    if dt.lora_in == dt.lora:
        return torch.native_dropout(_as(x, dt.lora_in, casts), m.p, True)
    mask = torch.native_dropout(torch.empty(x.shape, dtype=dt.lora_in, device=x.device), m.p, True)[1]
    return _adapter_input(x, m, mask, casts), mask


def proj_forward(x: torch.Tensor, m: Meta, t: dict, casts: dict | None = None, keep: dict | None = None) -> torch.Tensor:
    """PEFT's forward of one projection on 2-D x: base(x) + s * B(A(drop(x))), in m.dt's dtypes.
    keep: a dict to fill with what backward can reuse (KEPT), or None (backward recomputes it)."""
    dt = m.dt
    w = base_weight(m, t)
    bias = _to(t["bias"], dt.base) if m.bias else None
    y = _to(F.linear(_as(x, dt.base, casts), w, bias), dt.result)
    del w
    if not m.adapted:
        return y
    A, B = _to(t["A"], dt.lora), _to(t["B"], dt.lora)
    mask = t.get("mask")
    if mask is DRAW:
        xl, keep["mask"] = _draw(x, m, casts)
    else:
        xl = _adapter_input(x, m, mask, casts)
    xa = xl @ A.t()  # (n, r)
    del xl
    if keep is not None:
        if A is not t["A"]:
            keep["A"] = A
        if B is not t["B"]:
            keep["B"] = B
        keep[_kept_product(m)] = xa  # (scaled in place below where the scale is folded)
    if dt.lora_in == dt.lora == dt.add == dt.result:  # one dtype throughout
        if _power_of_two(m.scale):  # no temporary for the adapter's output: s (xa B^T) rounds as PEFT's
            return y.addmm_(xa, B.t(), alpha=m.scale)
        return y.add_(torch.mm(xa, B.t()).mul_(m.scale))  # PEFT's roundings: the product, its scale, the sum
    # casts between (autocast, PEFT's float32 adapters): PEFT's rounding steps, each as few passes as exact
    folded = _kept_product(m) == "xa_s"  # (the scale folded into the r-wide product)
    if folded and m.scale != 1.0:
        xa.mul_(m.scale)
    lora = torch.mm(xa, B.t())
    if not folded:
        lora.mul_(m.scale)
    if dt.out == y.dtype and torch.promote_types(y.dtype, lora.dtype) == dt.add:
        return y.add_(lora)  # computed in dt.add (the promoted dtype), stored in the result's: PEFT's add and cast back
    return y.to(dt.add).add_(lora.to(dt.add)).to(dt.out)


def proj_backward(dy: torch.Tensor, x: torch.Tensor, m: Meta, t: dict, dx, casts: dict | None = None,
                  kept: dict | None = None):
    """(dx, dA, dB) of proj_forward for output gradient dy and 2-D input x, replaying the forward's
    dtypes. dx: None (the first term), the running sum in x's dtype (added to in place), or False
    (x needs no gradient: the base's dx matmul is skipped, as autograd skips it). The adapter's term
    is added before the base's, the order in which autograd sums PEFT's two branches. kept: what
    proj_forward kept (KEPT), used instead of casting and multiplying again; the same values, so the
    same gradients bit for bit."""
    dt = m.dt
    kept = kept or {}
    # dy -> the sum's dtype -> back is the identity where the sum's dtype holds dy's: no copies then
    d_add = dy if _widens(dy.dtype, dt.add) else dy.to(dt.add)
    dA = dB = None
    if m.adapted:
        A = kept["A"] if "A" in kept else _to(t["A"], dt.lora)
        B = kept["B"] if "B" in kept else _to(t["B"], dt.lora)
        mask = kept["mask"] if "mask" in kept else t.get("mask")
        g = _to(d_add, dt.lora)
        xl = _adapter_input(x, m, mask, casts)
        if _power_of_two(m.scale):  # s (g B) = (s g) B exactly: the scale on the r-wide products
            gs = None
            u = (g @ B).mul_(m.scale)  # (n, r)
        else:  # PEFT's order (the scale's MulBackward first, rounded in g's dtype): rsLoRA's 16 / sqrt(8)
            gs = g * m.scale
            u = gs @ B
        if "xa_s" in kept:  # s (g^T xa) = g^T (s xa) exactly: the scale is a power of two (`_folded`)
            dB = _to(g.t() @ kept["xa_s"], t["B"].dtype)
        else:
            xa = kept["xa"] if "xa" in kept else xl @ A.t()
            dB = _to((g.t() @ xa).mul_(m.scale) if gs is None else gs.t() @ xa, t["B"].dtype)
        dA = _to(u.t() @ xl, t["A"].dtype)
        del xl, g, gs  # (gs: output-wide, where the scale is no power of two)
        if dx is not False:
            dx = _accumulate(dx, dropped(u @ A, mask, m.p, dt.lora_in, x.dtype, backward=True), x.dtype)
    if dx is not False:
        w = base_weight(m, t)
        dx = _accumulate(dx, _to(_to(d_add, dt.result), dt.base) @ w, x.dtype)
        del w
    return dx, dA, dB


# The activation. Its forward is the one the forward beneath the site runs with the adapters off
# (PEFT's reference pass), so that both passes compute the same base: accel_kernels' GLU ("kernel")
# where the `glu` swap beneath runs its kernel, else the module's own torch formula ("torch"),
# which rounds differently in half precision. The backward is accel_kernels' registered op, which
# takes the Triton kernel or its plain-torch twin as the public entry does.
GLU_KERNEL, GLU_TORCH = "kernel", "torch"
TORCH_ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


def glu_forward(act: str, gate: torch.Tensor, up: torch.Tensor, path: str = GLU_KERNEL) -> torch.Tensor:
    if path == GLU_TORCH:
        return TORCH_ACTS[act](gate) * up
    return mlp.glu(act, gate, up)


def glu_backward(act: str, dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    """(dgate, dup) of act(gate) * up: accel_kernels' `glu_backward` op, on the Triton path where
    the forward takes it (float64 runs the twin, as the public entry does). Called through the op's
    eager entry: its implementation directly in eager (no custom-op dispatch: tens of
    microseconds a call), `torch.ops.accel_kernels.glu_backward` while compiling."""
    from accel_kernels import _dispatch
    from accel_kernels.ops import _glu

    triton_path = _dispatch.use_triton(gate) and gate.dtype != torch.float64
    return _glu._glu_backward_op(dh, gate, up, act, triton_path)


# --------------------------------------------------------------------------------------------
# The ops: forward, backward, fake implementations, autograd formula
# --------------------------------------------------------------------------------------------


def _custom_op(name: str):
    return torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=())


def _rows(x: torch.Tensor):
    return x.reshape(-1, x.shape[-1])


def _n_rows(x: torch.Tensor):
    n = 1
    for d in x.shape[:-1]:
        n = n * d
    return n


def _adapter_grads(metas, grads) -> list:
    """The gradient list of the flat tensor input: dA, dB at each adapter's place, None elsewhere."""
    n, places = _adapter_places(metas)
    out = [None] * n
    for i, g in zip(places, grads):
        out[i] = g
    return out


@functools.lru_cache(maxsize=256)
def _adapter_places(metas) -> tuple[int, tuple[int, ...]]:
    """(length of the flat tensor list, the places of the adapters' A and B in it)."""
    places, i = [], 0
    for m in metas:
        for name in _names(m):
            if name in ("A", "B"):
                places.append(i)
            i += 1
    return i, tuple(places)


def _grad_fakes(metas, ts) -> list:
    return [t[name].new_empty(t[name].shape) for m, t in zip(metas, ts) if m.adapted for name in ("A", "B")]


def _linears(x: torch.Tensor, tensors: list[torch.Tensor], spec: str) -> list[torch.Tensor]:
    """Each projection of `spec` on x (2-D outputs): PEFT's LoRA forward, fused; then each adapted
    projection's r-wide product (`_kept_product`), which the registered autograd saves so that the
    backward op needs no matmul to remake it (r values a token a projection)."""
    metas, _ = parse(spec)
    keeps = [{} for _ in metas]
    return _linears_keeping(x, tensors, spec, keeps) + _products(metas, keeps)


def _linears_keeping(x, tensors, spec, keeps: list | None) -> list[torch.Tensor]:
    """_linears, filling keeps[i] (a dict per projection) with what backward can reuse (KEPT)."""
    metas, _ = parse(spec)
    x2, casts = _rows(x), {}
    keeps = keeps if keeps is not None else [None] * len(metas)
    return [proj_forward(x2, m, t, casts, k) for m, t, k in zip(metas, _split(metas, tensors), keeps)]


_linears_op = _custom_op("linears")(_linears)


def _product_fakes(metas, tensors, n: int, like: torch.Tensor) -> list[torch.Tensor]:
    return [like.new_empty((n, t["A"].shape[0]), dtype=m.dt.lora) for m, t in zip(metas, _split(metas, tensors))
            if m.adapted]


@_linears_op.register_fake
def _(x, tensors, spec):
    metas, _ = parse(spec)
    n = _n_rows(x)
    return [x.new_empty((n, m.out_features), dtype=m.dt.out) for m in metas] + _product_fakes(metas, tensors, n, x)


def _linears_bwd(douts: list[torch.Tensor], x: torch.Tensor, tensors: list[torch.Tensor],
                 products: list[torch.Tensor], spec: str, need_dx: bool) -> list[torch.Tensor]:
    """[dx (or an empty tensor when not needed), then dA, dB of every adapted projection]. products:
    the forward op's r-wide products (`_linears`), or [] (remade here)."""
    return _linears_bwd_kept(douts, x, tensors, spec, need_dx, _kept_dicts(parse(spec)[0], products))


def _linears_bwd_kept(douts, x, tensors, spec, need_dx, kepts: list | None) -> list[torch.Tensor]:
    """_linears_bwd with what the forward kept (a dict per projection, or None: recomputed)."""
    metas, _ = parse(spec)
    x2, casts = _rows(x), {}
    dx, grads = (None if need_dx else False), []
    kepts = kepts if kepts is not None else [None] * len(metas)
    # last projection first: the order in which autograd sums PEFT's separate calls into dx
    for m, t, dout, kept in reversed(list(zip(metas, _split(metas, tensors), douts, kepts))):
        dx, dA, dB = proj_backward(dout, x2, m, t, dx, casts, kept)
        if m.adapted:
            grads = [dA, dB] + grads
    return [dx.view(x.shape) if need_dx else x.new_empty(0)] + grads


_linears_backward_op = _custom_op("linears_backward")(_linears_bwd)


@_linears_backward_op.register_fake
def _(douts, x, tensors, products, spec, need_dx):
    metas, _ = parse(spec)
    return [x.new_empty(x.shape) if need_dx else x.new_empty(0)] + _grad_fakes(metas, _split(metas, tensors))


def _linears_setup(ctx, inputs, output):
    x, tensors, spec = inputs
    metas, _ = parse(spec)
    ctx.save_for_backward(x, *tensors, *output[len(metas):])  # the r-wide products after the inputs
    ctx.spec, ctx.need_dx, ctx.n_tensors = spec, x.requires_grad, len(tensors)


def _linears_backward(ctx, douts):
    _first_order()
    x, *saved = ctx.saved_tensors
    tensors, products = saved[:ctx.n_tensors], saved[ctx.n_tensors:]
    metas, _ = parse(ctx.spec)
    # (the products' own gradients are not used: they are outputs only for the saving)
    douts = [d if d is not None else x.new_zeros((_n_rows(x), m.out_features), dtype=m.dt.out)
             for d, m in zip(douts, metas)]
    grads = torch.ops.accel_patch_lora.linears_backward(douts, x, tensors, products, ctx.spec, ctx.need_dx)
    return (grads[0] if ctx.need_dx else None), _adapter_grads(metas, grads[1:]), None


_linears_op.register_autograd(_linears_backward, setup_context=_linears_setup)


def _mlp(x: torch.Tensor, tensors: list[torch.Tensor], spec: str) -> list[torch.Tensor]:
    """[down(act(gate(x)) * up(x)) as 2-D, gate, up, then each adapted projection's r-wide product]
    for the projections of `spec` (gate, up, down; or gate_up, down, where the second output is
    gate_up whole and the third an empty tensor). The registered autograd saves gate, up and the
    products (as `_linears`)."""
    metas, _ = parse(spec)
    keeps = [{} for _ in metas]
    return [*_mlp_keeping(x, tensors, spec, keeps), *_products(metas, keeps)]


def _mlp_keeping(x, tensors, spec, keeps: list | None):
    """_mlp, filling keeps[i] (a dict per projection) with what backward can reuse (KEPT)."""
    metas, (act, gate_first, path) = parse(spec)
    ts = _split(metas, tensors)
    x2, casts = _rows(x), {}
    keeps = keeps if keeps is not None else [None] * len(metas)
    if len(metas) == 3:
        gate = proj_forward(x2, metas[0], ts[0], casts, keeps[0])
        up = proj_forward(x2, metas[1], ts[1], casts, keeps[1])
        h = glu_forward(act, gate, up, path)
    else:
        gate = proj_forward(x2, metas[0], ts[0], None, keeps[0])  # gate_up whole
        up = x.new_empty(0)
        h = glu_forward(act, *_halves(gate, gate_first == "1"), path)
    out = proj_forward(h, metas[-1], ts[-1], None, keeps[-1])
    return out, gate, up


_mlp_op = _custom_op("mlp")(_mlp)


def _halves(gate_up: torch.Tensor, gate_first: bool):
    first, second = gate_up.chunk(2, dim=-1)
    return (first, second) if gate_first else (second, first)


@_mlp_op.register_fake
def _(x, tensors, spec):
    metas, _ = parse(spec)
    n = _n_rows(x)
    gate = x.new_empty((n, metas[0].out_features), dtype=metas[0].dt.out)
    up = x.new_empty((n, metas[1].out_features), dtype=metas[1].dt.out) if len(metas) == 3 else x.new_empty(0)
    out = x.new_empty((n, metas[-1].out_features), dtype=metas[-1].dt.out)
    return [out, gate, up, *_product_fakes(metas, tensors, n, x)]


def _mlp_bwd(dout: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
             tensors: list[torch.Tensor], products: list[torch.Tensor], spec: str, need_dx: bool) -> list[torch.Tensor]:
    """[dx (or an empty tensor when not needed), then dA, dB of every adapted projection]. products:
    the forward op's r-wide products (`_mlp`), or [] (remade here)."""
    return _mlp_bwd_kept(dout, x, gate, up, tensors, spec, need_dx, _kept_dicts(parse(spec)[0], products))


def _mlp_bwd_kept(dout, x, gate, up, tensors, spec, need_dx, kepts: list | None) -> list[torch.Tensor]:
    """_mlp_bwd with what the forward kept (a dict per projection, or None: recomputed)."""
    metas, (act, gate_first, path) = parse(spec)
    ts = _split(metas, tensors)
    kepts = kepts if kepts is not None else [None] * len(metas)
    fused = len(metas) == 2
    if fused:
        gate, up = _halves(gate, gate_first == "1")
    down = metas[-1]
    # the down adapter needs its input: recomputed, never saved (else only its dtype is read)
    h = glu_forward(act, gate, up, path) if down.adapted else gate
    dh, dAd, dBd = proj_backward(dout, h, down, ts[-1], None, None, kepts[-1])
    del h
    dgate, dup = glu_backward(act, dh, gate, up)
    del dh
    x2, casts = _rows(x), {}
    dx = None if need_dx else False
    if not fused:
        dx, dAu, dBu = proj_backward(dup, x2, metas[1], ts[1], dx, casts, kepts[1])  # up was called last
        dx, dAg, dBg = proj_backward(dgate, x2, metas[0], ts[0], dx, casts, kepts[0])
        grads = [(dAg, dBg), (dAu, dBu), (dAd, dBd)]
    else:
        dgu = torch.cat((dgate, dup) if gate_first == "1" else (dup, dgate), dim=-1)
        del dgate, dup
        dx, dA, dB = proj_backward(dgu, x2, metas[0], ts[0], dx, None, kepts[0])
        grads = [(dA, dB), (dAd, dBd)]
    flat = [g for m, pair in zip(metas, grads) if m.adapted for g in pair]
    return [dx.view(x.shape) if need_dx else x.new_empty(0)] + flat


_mlp_backward_op = _custom_op("mlp_backward")(_mlp_bwd)


@_mlp_backward_op.register_fake
def _(dout, x, gate, up, tensors, products, spec, need_dx):
    metas, _ = parse(spec)
    return [x.new_empty(x.shape) if need_dx else x.new_empty(0)] + _grad_fakes(metas, _split(metas, tensors))


def _mlp_setup(ctx, inputs, output):
    x, tensors, spec = inputs
    _, gate, up, *products = output
    ctx.save_for_backward(x, gate, up, *tensors, *products)
    ctx.spec, ctx.need_dx, ctx.n_tensors = spec, x.requires_grad, len(tensors)


def _mlp_backward(ctx, douts):
    _first_order()
    dout = douts[0]  # (gate's, up's and the products' gradients are not used: outputs only for the saving)
    x, gate, up, *saved = ctx.saved_tensors
    tensors, products = saved[:ctx.n_tensors], saved[ctx.n_tensors:]
    metas, _ = parse(ctx.spec)
    grads = torch.ops.accel_patch_lora.mlp_backward(dout, x, gate, up, tensors, products, ctx.spec, ctx.need_dx)
    return (grads[0] if ctx.need_dx else None), _adapter_grads(metas, grads[1:]), None


_mlp_op.register_autograd(_mlp_backward, setup_context=_mlp_setup)


# Eager: the same functions without the custom-op boundary, whose dispatch (the library's autograd
# wrapper, its dynamo-disabled entry) costs more host time a call than PEFT's three layers do at a
# few tokens (tests/swaps/lora/lora_census.py --timing). Under torch.compile the ops are traced.


class _NoAutocast:
    """Autocast off inside (as inside a custom op), only where it is on: the dtypes come in the spec.
    The flag alone is switched (0.8 us a block against torch.autocast(enabled=False)'s 3.0, timeit
    under CPU autocast): inside an enabled region the outer block keeps its nesting count and clears the
    cast cache at its own exit, and nothing here casts under autocast."""

    __slots__ = ("device_type", "was")

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type

    def __enter__(self):
        self.was = torch.is_autocast_enabled(self.device_type)
        if self.was:
            torch.set_autocast_enabled(self.device_type, False)

    def __exit__(self, *exc):
        if self.was:
            torch.set_autocast_enabled(self.device_type, True)
        return False


def _save(ctx, tensors, keeps) -> None:
    """save_for_backward of `tensors` then what the forward kept (KEPT, a dict per projection), so
    that saved-tensor hooks (checkpointing, offloading) see every tensor backward reads; the kept
    ones' places go in ctx.kept_at."""
    extra, at = [], []
    for i, keep in enumerate(keeps):
        for name in KEPT:
            if name in keep:
                at.append((i, name))
                extra.append(keep[name])
    ctx.save_for_backward(*(None if t is DRAW else t for t in tensors), *extra)  # drawn masks: kept
    ctx.kept_at = tuple(at)


def _restore(ctx, n_projections: int, n_tensors: int):
    """(the first n_tensors saved tensors, the kept dicts) as `_save` saved them."""
    saved = ctx.saved_tensors
    kepts = [{} for _ in range(n_projections)]
    for (i, name), t in zip(ctx.kept_at, saved[n_tensors:]):
        kepts[i][name] = t
    return saved[:n_tensors], kepts


class _EagerLinears(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, spec, *tensors):
        keeps = [{} for _ in parse(spec)[0]]
        with _NoAutocast(x.device.type):
            outs = _linears_keeping(x, list(tensors), spec, keeps)
        _save(ctx, (x, *tensors), keeps)
        ctx.spec, ctx.need_dx = spec, ctx.needs_input_grad[0]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *douts):
        _first_order()
        metas, _ = parse(ctx.spec)
        (x, *tensors), kepts = _restore(ctx, len(metas), 1 + sum(m.n_tensors for m in metas))
        douts = [d if d is not None else x.new_zeros((_n_rows(x), m.out_features), dtype=m.dt.out)
                 for d, m in zip(douts, metas)]
        with _NoAutocast(x.device.type):
            grads = _linears_bwd_kept(douts, x, tensors, ctx.spec, ctx.need_dx, kepts)
        return (grads[0] if ctx.need_dx else None), None, *_adapter_grads(metas, grads[1:])


class _EagerMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, spec, *tensors):
        keeps = [{} for _ in parse(spec)[0]]
        with _NoAutocast(x.device.type):
            out, gate, up = _mlp_keeping(x, list(tensors), spec, keeps)
        _save(ctx, (x, gate, up, *tensors), keeps)
        ctx.spec, ctx.need_dx = spec, ctx.needs_input_grad[0]
        return out

    @staticmethod
    def backward(ctx, dout):
        _first_order()
        metas, _ = parse(ctx.spec)
        (x, gate, up, *tensors), kepts = _restore(ctx, len(metas), 3 + sum(m.n_tensors for m in metas))
        with _NoAutocast(x.device.type):
            grads = _mlp_bwd_kept(dout, x, gate, up, tensors, ctx.spec, ctx.need_dx, kepts)
        return (grads[0] if ctx.need_dx else None), None, *_adapter_grads(metas, grads[1:])


def _fast_apply(function):
    """`function.apply` without its Python half (which unwraps functorch's dead wrappers over every
    argument, a dozen tensors here: about 10 us a call), where no functorch transform is active;
    the Python half where one is."""
    direct = torch._C._FunctionBase.__dict__["apply"].__get__(None, function)

    def apply(*args):
        if torch._C._are_functorch_transforms_active():
            return function.apply(*args)
        return direct(*args)
    return apply


_apply_linears, _apply_mlp = _fast_apply(_EagerLinears), _fast_apply(_EagerMLP)


# --------------------------------------------------------------------------------------------
# Entries: dropout drawn here, in PEFT's order; everything else in the ops
# --------------------------------------------------------------------------------------------


def _adapter_pairs(projs, adapters):
    """Per projection, its (A, B) from the flat adapter inputs, or (None, None)."""
    it = iter(adapters)
    return [(next(it), next(it)) if p.adapted else (None, None) for p in projs]


def dropout_mask(shape, like: torch.Tensor | None, p: Proj, x_dtype, A, device):
    """The bool mask PEFT's dropout would draw now on the adapter input of projection p (shape,
    strides, dtype and device of what its `nn.Dropout` sees), or None when no dropout applies. The
    same RNG call F.dropout makes there: `native_dropout` where it runs the fused kernel, else
    `empty_like(input).bernoulli_(1 - p)` (ATen's `_dropout_impl`). Returned 2-D ([rows, width], the
    fused functions' view of the input), so that the three uses a call makes of it need no reshape."""
    if not p.adapted or p.dropout == 0:
        return None
    dtype = dtypes(p, x_dtype, A.dtype).lora_in
    if like is not None:
        noise = torch.empty_like(like, dtype=dtype)
    else:
        noise = torch.empty(shape, dtype=dtype, device=device)
    if noise.device.type in _FUSED_DROPOUT:
        # the kernel's mask is its RNG draw compared with 1 - p, whatever the input's values: the
        # noise stays unwritten (no fill pass of its [tokens, width] before the draw)
        mask = torch.native_dropout(noise, p.dropout, True)[1]
    else:
        mask = noise.bernoulli_(1 - p.dropout) != 0
    return mask.reshape(-1, mask.shape[-1])


def _draws_inside(x: torch.Tensor) -> bool:
    """Whether an eager call draws its dropout masks inside the forward (`DRAW`): where F.dropout
    runs the fused kernel, on a contiguous x (the layout PEFT's dropout input has, whose draw the
    kernel's vectorized path makes), outside torch.compile (the ops stay deterministic there)."""
    return x.device.type in _FUSED_DROPOUT and x.is_contiguous() and not torch.compiler.is_compiling()


def _mask(inside: bool, p: Proj, shape, like, x_dtype, A, device):
    """DRAW where the forward draws the mask itself (a dropped projection of an `inside` call), else
    the mask drawn now (`dropout_mask`) or None."""
    if inside:
        return DRAW if p.adapted and p.dropout > 0 else None
    return dropout_mask(shape, like, p, x_dtype, A, device)


def linears_inputs(x, projs, adapters, inside: bool = False) -> tuple:
    """The `linears` op's arguments (x, tensors, spec) for these projections; draws the dropout masks
    (inside: leaves DRAW in their places, for the eager forward)."""
    items, tensors = [], []
    for p, (A, B) in zip(projs, _adapter_pairs(projs, adapters)):
        mask = _mask(inside, p, None, x, x.dtype, A, x.device)
        item, ts = _inputs(x.dtype, p, (A, B), mask)
        items.append(item)
        tensors += ts
    return x, tensors, "|".join(items)


def fused_linears(x, projs, adapters) -> tuple[torch.Tensor, ...]:
    """Every projection of `projs` on x (PEFT's forward of each, one autograd node, x saved once)."""
    x, tensors, spec = linears_inputs(x, projs, adapters, _draws_inside(x))
    if torch.compiler.is_compiling():
        outs = torch.ops.accel_patch_lora.linears(x, tensors, spec)[:len(parse(spec)[0])]  # then the products
    else:
        outs = _apply_linears(x, spec, *tensors)
    return tuple(o.view(*x.shape[:-1], o.shape[-1]) for o in outs)


def mlp_inputs(x, projs, adapters, act: str, gate_first: bool, glu_path: str = GLU_KERNEL,
               inside: bool = False) -> tuple:
    """The `mlp` op's arguments (x, tensors, spec); draws the dropout masks (gate, up, down; inside:
    leaves DRAW in their places, all three, so that the forward draws them in PEFT's order).
    glu_path: GLU_KERNEL or GLU_TORCH, how act(gate) * up is computed (`glu_forward`)."""
    projs = tuple(projs)
    pairs = _adapter_pairs(projs, adapters)
    first = projs[0]
    gate_dtype = dtypes(first, x.dtype, pairs[0][0].dtype if first.adapted else None).out
    inter = _out_features(first) // (2 if len(projs) == 2 else 1)
    items, tensors = [], []
    for i, (p, (A, B)) in enumerate(zip(projs, pairs)):
        if i == len(projs) - 1:  # down reads act(gate) * up
            in_dtype = gate_dtype
            mask = _mask(inside, p, (*x.shape[:-1], inter), None, in_dtype, A, x.device)
        else:
            in_dtype = x.dtype
            mask = _mask(inside, p, None, x, in_dtype, A, x.device)
        item, ts = _inputs(in_dtype, p, (A, B), mask)
        items.append(item)
        tensors += ts
    return x, tensors, "|".join(items) + f";{act},{int(gate_first)},{glu_path}"


def fused_mlp(x, projs, adapters, act: str, gate_first: bool, glu_path: str = GLU_KERNEL) -> torch.Tensor:
    """down(act(gate(x)) * up(x)) with PEFT's LoRA forward on each projection: one autograd node
    saving x, gate, up and the dropout masks."""
    x, tensors, spec = mlp_inputs(x, projs, adapters, act, gate_first, glu_path, _draws_inside(x))
    if torch.compiler.is_compiling():
        out = torch.ops.accel_patch_lora.mlp(x, tensors, spec)[0]
    else:
        out = _apply_mlp(x, spec, *tensors)
    return out.view(*x.shape[:-1], out.shape[-1])


def _out_features(p: Proj) -> int:
    return p.weight.quant_state.shape[0] if p.kind == "4bit" else p.weight.shape[0]
