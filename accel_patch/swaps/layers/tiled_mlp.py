"""The tiled MLP: an MLP (gated, or non-gated `down(act(up(x)))`) computed over chunks of tokens,
so that its working set is one chunk's.

    forward:  out[rows] = mlp(x[rows]) for each chunk, without grad: nothing of a chunk is kept
    backward: for each chunk, mlp(x[rows]) again with grad, then its gradients for dout[rows]:
              dx[rows], and every trainable parameter's (LoRA adapters included) summed over chunks

`_TiledFunction` wraps whatever forward the MLP runs now (stock, the `glu` kernel forward, the
fused LoRA MLP, a 4-bit base): it calls that forward on rows of the flattened input, so it adds no
math of its own. The chunk's recompute in backward replays the forward's autocast state and, chunk
by chunk, its RNG state (LoRA dropout draws the same masks), as torch.utils.checkpoint does. The
trainable parameters are inputs of the function, so autograd accumulates their gradients and
every engine that hooks them (DDP, FSDP2) sees them as from a stock backward.

Decided at every call, counted in the model's `calls["tiled_mlp"]`: "tiled", or why the forward
beneath ran instead (a short sequence, no grad, not checkpointed, ...). Tiling pays once
tokens x intermediate reaches MIN_ELEMENTS; a chunk holds about CHUNK_ELEMENTS (chunk tokens x
intermediate) elements.

When it engages (docs/tiled-mlp.md, "When it engages"): the backward's chunk recompute is
one more MLP forward, which gradient checkpointing pays anyway. So by default (`ops=None`, no
ACCEL_PATCH_KERNELS, no config entry) a long call tiles only under transformers' gradient
checkpointing: the `gradient_checkpointing` flag of the nearest module above the MLP that has one
(the decoder layer; `gradient_checkpointing_enable` / `activation_checkpointing_enable` set it,
per layer with `every_n_layers`) is on and that module is training, read at every call. Elsewhere it tiles only when the caller named the op (`ops=` with "tiled_mlp",
ACCEL_PATCH_KERNELS, the config entry): `Site.requested`. No memory rule engages it on its own: a
site sees one MLP, not what else the step holds. Checkpointing by other means (torch.utils.checkpoint
by hand, FSDP's checkpoint wrapper) sets no such flag: ask for the op there.

Gradient checkpointing (non-reentrant, transformers' default): the input is saved by a separate
identity node before the chunks run, and the function saves nothing itself, so checkpoint's
recompute (which stops once the last saved tensor is recomputed) stops before the MLP when nothing
after it in the layer saves a tensor (Llama, Mistral, Qwen, Phi3): the MLP runs twice per step, as
in a stock checkpointed step (forward, then once in backward), not three times. Where a norm after
the MLP saves its output (Gemma2's post-feedforward norm), and under reentrant checkpointing (whose
forward runs without grad: the forward beneath, counted "no grad"), the recompute runs it once more.
"""
from __future__ import annotations


import torch

from .. import probe, sites
from . import mlp

OP = "tiled_mlp"
#: Instance attribute holding the tiled site's call-time data (`Site`).
SITE_ATTR = "_accel_patch_tiled_site"
#: Instance attribute holding the forward the tiled site replaced (a LoRA site's, glu's, an
#: accelerate wrapper), which it tiles and falls back to.
INNER_ATTR = "_accel_patch_tiled_inner"

#: Tiling engages from this many elements of tokens x intermediate (one intermediate tensor), and
#: from two chunks. Measured on CPU (`benchmarks/long_context.py --crossover`: one Llama MLP,
#: hidden 512, intermediate 2048, fp32): the tiled step's peak memory is above the plain one's up to
#: 2048 tokens (4M elements: 126 vs 117 MiB) and below it from 4096 (8M: 142 vs 221 MiB), for one
#: more MLP forward in time (none under checkpointing): docs/tiled-mlp.md, "Threshold and chunk".
MIN_ELEMENTS = 2 ** 23
#: Elements of one chunk's intermediate tensor (chunk tokens x intermediate), but at least `hidden`
#: tokens a chunk (a chunk's activations then weigh about one weight matrix, and a GPU's matmuls
#: stay large): 512 tokens at hidden 512 / intermediate 2048, 2048 at Llama-3.2-1B's 2048 / 8192.
CHUNK_ELEMENTS = 2 ** 20

TILED = "tiled"
SHORT = "short sequence: the module's forward"
NO_GRAD = "no grad: the module's forward"
EVAL = "eval mode: the module's forward"
NO_CHECKPOINTING = ("not checkpointed: the module's forward (tiling would add one MLP forward; "
                    "ask for tiled_mlp to tile anyway)")
#: The attribute transformers' `gradient_checkpointing_enable` turns on, on every module that has it.
CHECKPOINT_FLAG = "gradient_checkpointing"


class Site:
    """What a tiled site reads at call time: the MLP's widths, the model's call counts, whether the
    caller asked for the op by name (`requested`: tile every long training call), and the modules
    above the MLP whose `gradient_checkpointing` flag says the layer is checkpointed (`holders`)."""

    def __init__(self, hidden: int, intermediate: int, calls, requested: bool = False, holders=()) -> None:
        self.hidden, self.intermediate, self.calls = hidden, intermediate, calls
        self.requested, self.holders = requested, tuple(holders)

    def checkpointed(self) -> bool:
        """Whether transformers checkpoints the layer of this MLP now: the flag of the nearest module
        above that carries one (the decoder layer in transformers 5, whose flag `every_n_layers`
        sets per layer; the base model in 4.x), in training."""
        if not self.holders:
            return False
        nearest = self.holders[-1]
        return getattr(nearest, CHECKPOINT_FLAG, False) is True and nearest.training

    def count(self, outcome: str) -> None:
        sites.count_into(self.calls, OP, outcome)


def checkpoint_holders(model, where: str) -> list:
    """The modules above `where` (a name in `model.named_modules()`) that carry transformers'
    `gradient_checkpointing` flag, outermost first: the base model, the decoder layer."""
    parts = where.split(".") if where else []
    holders = [model] if hasattr(model, CHECKPOINT_FLAG) else []
    for i in range(1, len(parts)):
        try:
            module = model.get_submodule(".".join(parts[:i]))
        except AttributeError:
            continue
        if hasattr(module, CHECKPOINT_FLAG):
            holders.append(module)
    return holders


def chunk_tokens(hidden: int, intermediate: int) -> int:
    """Tokens per chunk: CHUNK_ELEMENTS / intermediate, at least `hidden` (and 1)."""
    return max(1, hidden, CHUNK_ELEMENTS // max(1, intermediate))


def call_inner(module, *args, **kwargs):
    """The forward the tiled site replaced (another swap's, or the class's)."""
    return sites.call_kept(INNER_ATTR, module, *args, **kwargs)


def decide(site: Site, module, x) -> str | None:
    """None when this call is tiled, else the reason the forward beneath runs."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        return "input is not a tensor of tokens: the module's forward"
    tokens = x.numel() // x.shape[-1]
    if tokens * site.intermediate < MIN_ELEMENTS or tokens < 2 * chunk_tokens(site.hidden, site.intermediate):
        return SHORT
    if not torch.is_grad_enabled():
        return NO_GRAD
    if not module.training:  # (bitsandbytes' Linear4bit repacks its weight at a no-grad call in eval mode)
        return EVAL
    if not site.requested and not site.checkpointed():
        return NO_CHECKPOINTING
    if sites.is_dtensor(x) or any(sites.is_dtensor(p) for p in module.parameters()):
        return "DTensor input or parameters: the module's forward"
    return None


def forward(self, *args, **kwargs):
    """The swapped MLP: its current forward over chunks of tokens when the call is long enough."""
    site = self.__dict__.get(SITE_ATTR)
    if site is None or sites.compiling():
        return call_inner(self, *args, **kwargs)
    x = sites.the_input(args, kwargs)
    reason = decide(site, self, x)
    if reason is not None:
        site.count(reason)
        return call_inner(self, *args, **kwargs)
    out = tiled(self, x, chunk_tokens(site.hidden, site.intermediate))
    site.count(TILED)  # after: a checkpoint's recompute that stops before the chunks run is no call
    return out


def tiled(module, x: torch.Tensor, chunk: int) -> torch.Tensor:
    """`call_inner(module, x)` computed `chunk` tokens at a time (see the module docstring)."""
    params = [p for p in module.parameters() if p.requires_grad]
    anchor = None
    if x.requires_grad:
        x = _SaveInput.apply(x)
        anchor = x.grad_fn
    return _TiledFunction.apply(x, _Runner(module), chunk, anchor, *params)


class _Runner:
    """Calls the forward beneath the tiled site on a chunk of rows (2-D)."""

    __slots__ = ("module",)

    def __init__(self, module) -> None:
        self.module = module

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return call_inner(self.module, rows)


class _SaveInput(torch.autograd.Function):
    """Identity that saves x for the tiled function: packed before the chunks run, it is the last
    tensor a checkpointed layer saves, so a non-reentrant recompute stops before the MLP."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _rng_state(device: torch.device):
    state = [torch.get_rng_state()]
    if device.type != "cpu":
        state.append(torch.get_device_module(device.type).get_rng_state(device))
    return state


def _set_rng_state(device: torch.device, state) -> None:
    torch.set_rng_state(state[0])
    if device.type != "cpu":
        torch.get_device_module(device.type).set_rng_state(state[1], device)


def _autocast_state(device: torch.device):
    """The autocast settings to replay in backward: (device type, enabled, dtype) of the input's
    device and of the CPU, and the cache flag."""
    types = [device.type] if device.type == "cpu" else [device.type, "cpu"]
    return [sites.autocast_state(t) for t in types], torch.is_autocast_cache_enabled()


class _TiledFunction(torch.autograd.Function):
    """run(x) over chunks of rows; backward recomputes one chunk at a time (module docstring)."""

    @staticmethod
    def forward(ctx, x, run, chunk, anchor, *params):
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        ctx.rng = []
        out = None
        for start in range(0, n, chunk):
            ctx.rng.append(_rng_state(x.device))
            part = run(rows[start:start + chunk])
            if out is None:
                out = part.new_empty((n, part.shape[-1]))
            out[start:start + chunk] = part
            del part
        ctx.run, ctx.chunk, ctx.anchor, ctx.params = run, chunk, anchor, params
        ctx.autocast = _autocast_state(x.device)
        ctx.x_meta = (x.shape, x.device)
        if anchor is None:
            ctx.save_for_backward(x)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, dout):
        x = ctx.anchor.saved_tensors[0] if ctx.anchor is not None else ctx.saved_tensors[0]
        shape, device = ctx.x_meta
        rows = x.reshape(-1, shape[-1])
        drows = dout.reshape(-1, dout.shape[-1])
        need_x = ctx.needs_input_grad[0]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[4:]) if need]
        targets = [ctx.params[i] for i in wanted]
        dx = torch.empty_like(rows) if need_x else None
        dparams = [None] * len(targets)
        casts, cache = ctx.autocast
        devices = [device] if device.type != "cpu" else []
        with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
            for i, start in enumerate(range(0, rows.shape[0], ctx.chunk)):
                _set_rng_state(device, ctx.rng[i])
                part = rows[start:start + ctx.chunk].detach().requires_grad_(need_x)
                with torch.enable_grad(), _replayed_autocast(casts, cache):
                    out = ctx.run(part)
                inputs = ([part] if need_x else []) + targets
                grads = torch.autograd.grad(out, inputs, drows[start:start + ctx.chunk].to(out.dtype),
                                            allow_unused=True)
                del out
                if need_x:
                    dx[start:start + ctx.chunk] = grads[0]
                    grads = grads[1:]
                for j, g in enumerate(grads):
                    if g is None:
                        continue
                    if dparams[j] is None:
                        dparams[j] = g
                    else:
                        dparams[j] += g
                del grads, part
        full = [None] * len(ctx.params)
        for i, g in zip(wanted, dparams):
            full[i] = g
        return (dx.view(shape) if need_x else None, None, None, None, *full)


class _replayed_autocast:
    """Autocast as it was during the forward, for a recompute in backward (which runs without it)."""

    def __init__(self, casts, cache) -> None:
        self.contexts = [torch.autocast(device_type=t, dtype=d, enabled=e, cache_enabled=cache) for t, e, d in casts]

    def __enter__(self):
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.contexts):
            c.__exit__(*exc)
        return False


# --------------------------------------------------------------------------------------------
# Candidates and probe (at swap time)
# --------------------------------------------------------------------------------------------


def projections(module) -> tuple[str, ...] | None:
    """The MLP's projection names, first to down: a gated MLP's (mlp.candidate) or a non-gated
    one's (up, down), or None."""
    plain = mlp.plain_names(module)
    if plain is not None:
        return plain
    found = mlp.candidate(module)
    return None if found is None or isinstance(found, str) else found[0]


def candidate(module):
    """(hidden, intermediate) widths of an MLP the tiled site can run (the input widths of its
    first and its down projection), a refusal reason, or None. Gated MLPs as the glu site finds
    them, and non-gated ones, `down(act(up(x)))` (Nemotron-H's ReLU², Apertus's xIELU, whose
    activation's own parameters train through the chunks like the projections'): the tiled
    function only calls the forward beneath on rows, so any activation is the module's own."""
    names = mlp.plain_names(module)
    if names is not None:
        if sites.single_input(type(module)) is None:
            return "non-gated MLP whose forward takes more than one input"
    else:
        found = mlp.candidate(module)
        if found is None or isinstance(found, str):
            return found
        names = found[0]
    widths = (mlp._in_features(module, names[0]), mlp._in_features(module, names[-1]))
    for name, width in zip((names[0], names[-1]), widths):
        if width is None:
            return f"cannot tell the input width of {name}"
    return widths


def _dropout_active(module) -> bool:
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 and m.training for m in module.modules())


def probe_verdict(module, act_dtype: torch.dtype, names) -> bool | str:
    """True when the tiled function reproduces the module's forward on a small random probe (15
    rows in chunks of 4, 4, 4 and 3): output and gradients (of x and of every trainable parameter)
    equal to the same chunks run one after another with grad (the same RNG stream), and, when no
    dropout is active, to one call over all rows; else a refusal reason. Runs in training mode, as
    the site does (bitsandbytes' Linear4bit repacks its weight at a no-grad call in eval mode); the
    training flags are put back."""
    hidden = mlp._in_features(module, names[0])
    if hidden is None:
        return f"cannot tell the input width of {names[0]}"
    device = probe.module_device(module)
    flags = [(m, m.training) for m in module.modules()]
    module.train()
    try:
        with probe.probing(module):
            x = probe.randn((3, 5, hidden), act_dtype, device).requires_grad_()
            leaves = [x] + [p for p in module.parameters() if p.requires_grad]
            rows = x.reshape(-1, hidden)
            refs = {}
            probe.seeded()
            refs["the same chunks with grad"] = torch.cat([call_inner(module, rows[s:s + 4]) for s in range(0, 15, 4)])
            if not _dropout_active(module):
                refs["one call over all tokens"] = call_inner(module, x).reshape(15, -1)
            dy = probe.randn(refs["the same chunks with grad"].shape, act_dtype, device)
            ref_grads = {k: torch.autograd.grad(r, leaves, dy, allow_unused=True) for k, r in refs.items()}
            probe.seeded()
            got = tiled(module, x, 4).reshape(15, -1)
            got_grads = torch.autograd.grad(got, leaves, dy, allow_unused=True)
    except Exception as exc:
        return f"probe failed: {type(exc).__name__}: {exc}"
    finally:
        for m, flag in flags:
            m.training = flag
    limit = probe.bound(act_dtype)
    for what, ref in refs.items():
        if got.dtype != ref.dtype:
            return f"the tiled forward returns {got.dtype}, the module {ref.dtype}"
        err = probe.rel_err(got, ref)
        if err > limit:
            return f"the tiled forward differs from {what}: relative error {err:.2e} > {limit:.1e}"
        for i, (g, r) in enumerate(zip(got_grads, ref_grads[what])):
            if (g is None) != (r is None) or (r is not None and probe.rel_err(g, r) > limit):
                name = "x" if i == 0 else f"parameter {i - 1}"
                return f"the tiled gradient of {name} differs from {what}'s"
    return True


def install(state, module, site: Site) -> None:
    """Bind the tiled forward on top of whatever the module runs now (kept in INNER_ATTR)."""
    state.set(module, SITE_ATTR, site)
    sites.install(state, module, sites.signed(forward, type(module), OP), INNER_ATTR)


def request(model) -> None:
    """Every tiled site of `model` tiles long training calls without checkpointing too (the caller
    named the op after a default swap had installed them): the tiled MLPs and every other site
    that tiles by this rule (MoE experts), whose site objects carry `requested` too."""
    for module in model.modules():
        for site in list(module.__dict__.values()):
            if hasattr(site, "requested") and hasattr(site, "holders"):
                site.requested = True


def op_of(module) -> str | None:
    bound = module.__dict__.get(sites.forward_slot(module))
    return getattr(getattr(bound, "__func__", None), sites.MARK, None)

