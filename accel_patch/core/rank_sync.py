"""Are the ranks still training one model? A checksum of the trainable parameters every rank holds
whole, compared across ranks with one collective.

    result = accel_patch.check_rank_sync(model)   # on every rank, at the same point of the loop
    if not result.ok:
        print(result)      # "DRIFT: rank(s) 1 differ from rank 0 at step 40: 2/12 tensors, ~3.1e-04, ..."

The checksum reads each tensor's bit patterns as integers (`view` as int16/int32/...), mixes every
element with its position (an injective integer mix, wrapping int64 arithmetic) and sums: one
element changed by one ulp always changes the sum (the mix is a bijection of the element for a
given position, and integer addition modulo 2**64 cannot cancel one changed term), and the sum is
the same whatever the order of the reduction (integer addition is associative, also under GPU
atomics), so bitwise-equal replicas never alarm. A float sum would do neither. Beside it a signed
float64 sum of the values (a random +-1 projection: a single changed element moves it by exactly
its change, a spread change by about the L2 norm of the change) says how far apart the ranks are.

Compared: parameters with `requires_grad` that every rank holds whole (DDP replicas, a plain
multi-process run). Sharded parameters (FSDP's DTensors and flat parameters, DeepSpeed ZeRO-3
partitions) are the engine's to keep consistent: counted and left out. Data-parallel training
keeps replicas bitwise equal: DDP (and accelerate, DeepSpeed ZeRO-1/2) broadcasts rank 0's weights
at wrapping and all-reduces the gradients, and every rank receives the same reduced bits, so
the same optimizer step gives the same weights, whatever the reduction's own (non)determinism.
What does alarm is real: a rank that trains alone (no DDP, a skipped collective, a hand-written
loop that never called `prepare`), or an optimizer or kernel that is nondeterministic *per rank*
(its result depends on the rank's own run, not only on the reduced gradients): those replicas
differ, which is drift.

All ranks receive every rank's digests (one `all_gather` of a fixed-size int64 tensor: 4 header
words and 2 x 256 slots), so every rank reaches the same verdict at the same step and can stop
together (`ACCEL_PATCH_SYNC_CHECK=error`) without leaving one rank waiting in a collective.

Settings, read by the Trainer callback at `on_train_begin`:
- `ACCEL_PATCH_SYNC_EVERY`: unset or "auto" (default): at the first log, then at an interval that
  keeps the check's own time under 0.5% of the step time (measured on every check, agreed by all
  ranks through the same collective; at most every 1000 steps); N: at the first log and every N
  steps; 0: never.
- `ACCEL_PATCH_SYNC_CHECK`: "warn" (default: the logged value and a warning on rank 0) or
  "error" (the run stops with the message).
"""
from __future__ import annotations

import math
import os
import time
from collections import namedtuple

from .log_line import fit

EVERY_VAR = "ACCEL_PATCH_SYNC_EVERY"
MODE_VAR = "ACCEL_PATCH_SYNC_CHECK"
MODES = ("warn", "error")
#: The share of the step time the automatic interval allows the check.
BUDGET = 0.005
MAX_AUTO_EVERY = 1000
SLOTS = 256  # tensors are folded into this many slots (tensor i -> slot i % SLOTS): a fixed-size collective
HEADER = 4  # tensors compared, sharded tensors left out, proposed interval, step

_MASK64 = (1 << 64) - 1
_POSITION = 0x9E3779B97F4A7C15  # golden-ratio multiplier: positions spread over all 64 bits
_SCRAMBLE = 0xBF58476D1CE4E5B9  # splitmix64's multiplier
_SIGNS = 0x94D049BB133111EB
_LOW35 = (1 << 35) - 1  # a logical shift right by 29 on int64: arithmetic shift, then mask
_INT_OF_SIZE = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


def _i64(x: int) -> int:
    """A Python integer as the int64 with the same low 64 bits (wrapping)."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


# --- settings -----------------------------------------------------------------------------------
def sync_every(environ=None) -> int | None:
    """ACCEL_PATCH_SYNC_EVERY: None for automatic (unset, blank or "auto"), 0 for off, else N >= 1."""
    raw = (os.environ if environ is None else environ).get(EVERY_VAR, "")
    value = raw.strip().lower()
    if value in ("", "auto"):
        return None
    if value.isdigit():
        return int(value)
    raise ValueError(f"{EVERY_VAR}={raw!r} is not valid: use a whole number of steps >= 0 "
                     f"(0 turns the rank-sync check off) or 'auto'")


def sync_mode(environ=None) -> str:
    """ACCEL_PATCH_SYNC_CHECK: "warn" (unset or blank) or "error"."""
    raw = (os.environ if environ is None else environ).get(MODE_VAR, "")
    value = raw.strip().lower() or "warn"
    if value not in MODES:
        raise ValueError(f"{MODE_VAR}={raw!r} is not valid: use 'warn' (the default: log and warn) "
                         f"or 'error' (stop the run on drift)")
    return value


def auto_every(check_seconds: float, step_seconds: float | None) -> int:
    """The interval in steps that keeps `check_seconds` per check under BUDGET of the step time."""
    if not step_seconds or step_seconds <= 0:
        return 1
    return max(1, min(MAX_AUTO_EVERY, math.ceil(check_seconds / (BUDGET * step_seconds))))


# --- which parameters ---------------------------------------------------------------------------
def sharded(p) -> bool:
    """Whether a sharding engine holds `p` in pieces: FSDP2 DTensor, FSDP1 flat parameter, ZeRO-3."""
    return (hasattr(p, "device_mesh") and hasattr(p, "placements")) or hasattr(p, "ds_id") \
        or bool(getattr(p, "_is_flat_param", False)) or bool(getattr(p, "_fsdp_flattened", False))


def replicated_trainable(model) -> tuple[list[str], list, int]:
    """(names, tensors) of the trainable parameters every rank holds whole, in a fixed order, and
    how many trainable ones are sharded (left out)."""
    names, tensors, n_sharded = [], [], 0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if sharded(p):
            n_sharded += 1
        elif p.device.type != "meta":
            names.append(name)
            tensors.append(p.detach())
    return names, tensors, n_sharded


# --- the checksum -------------------------------------------------------------------------------
class _Constants:
    """Per device and chunk length: the position weights, the +-1 signs of the projection, and work
    buffers (int64, int64, float64) reused by every chunk: a fresh 8-byte tensor per chunk costs
    page faults on CPU, more than the arithmetic."""

    def __init__(self) -> None:
        self._cache = {}

    def get(self, device, n: int):
        import torch

        key = (str(device), n)
        found = self._cache.get(key)
        if found is None:
            positions = torch.arange(n, dtype=torch.int64, device=device)
            weights = positions * _i64(_POSITION)
            signs = torch.where((positions * _i64(_SIGNS)) < 0, -1.0, 1.0).to(torch.float64)
            work = (torch.empty(n, dtype=torch.int64, device=device), torch.empty(n, dtype=torch.int64, device=device),
                    torch.empty(n, dtype=torch.float64, device=device))
            found = self._cache[key] = (weights, signs, work)
        return found

    def release_accelerators(self) -> None:
        """Drop every entry but the CPU's: a device's five chunk-long tensors (40 bytes an element)
        go back to its allocator once a check ends, for the training it runs between checks."""
        self._cache = {key: value for key, value in self._cache.items() if key[0] == "cpu"}


_constants = _Constants()


def _chunk_len(device) -> int:
    # CPU: work buffers that stay in cache (2**17 int64: 1 MiB; 1.4x faster than 2**20 here);
    # GPU: large enough that launches do not dominate (2**22: a few launches per 4M elements), small
    # enough that the check's buffers (160 MiB, freed after it) do not crowd the training's memory
    return 1 << (22 if device.type != "cpu" else 17)


def _as_ints(flat):
    """The bit patterns of a flat tensor as integers of its element size."""
    import torch

    dtype = getattr(torch, _INT_OF_SIZE.get(flat.element_size(), "uint8"))
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
        dtype = getattr(torch, _INT_OF_SIZE[flat.element_size()])
    return flat.view(dtype) if flat.dtype != dtype else flat


def _mix(ints, start: int):
    """Each element mixed with its position (start + i): an injective function of the element, in
    a work buffer (valid until the next call)."""
    import torch

    n = ints.numel()
    weights, _, (x, t, _) = _constants.get(ints.device, _chunk_len(ints.device))
    x, t = x[:n], t[:n]
    x.copy_(ints)  # sign-extended to int64
    x.bitwise_xor_(weights[:n])
    x.bitwise_xor_(_i64(start * _POSITION))
    x.mul_(_i64(_SCRAMBLE))  # odd multiplier: a bijection modulo 2**64
    torch.bitwise_right_shift(x, 29, out=t)
    t.bitwise_and_(_LOW35)
    x.bitwise_xor_(t)  # xorshift (a logical shift: arithmetic, then masked): a bijection
    return x


def _projection(values, signs):
    """sum(values * signs) in float64, through the work buffer."""
    import torch

    n = values.numel()
    buffer = _constants.get(values.device, _chunk_len(values.device))[2][2][:n]
    buffer.copy_(values)
    return torch.dot(buffer, signs[:n])


def digest_tensors(tensors, device=None):
    """(hashes, sketches): int64 and float64 tensors of SLOTS entries on `device` (the first tensor's
    by default). Tensor i goes to slot i % SLOTS; a tensor's hash depends on every bit of it and on
    its place in the list. Nothing here waits for the device (no .item(); the small tensors' slot
    numbers go to the device from pinned memory). Work buffers on an accelerator are released at
    the end."""
    try:
        return _digest(tensors, device)
    finally:
        _constants.release_accelerators()


def _digest(tensors, device):
    import torch

    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    hashes = torch.zeros(SLOTS, dtype=torch.int64, device=device)
    sketches = torch.zeros(SLOTS, dtype=torch.float64, device=device)
    offset = 0  # a running position over every element of every tensor
    batch: list = []  # small tensors of one device, hashed together: one pass instead of one per tensor
    batch_slots: list = []
    batch_len = 0

    def flush():
        nonlocal offset, batch_len
        if not batch:
            return
        dev = batch[0].device
        ints = torch.cat([_as_ints(t) for t in batch])
        # slot and length of each tensor; from pinned memory on an accelerator, so the copy does
        # not wait for the work queued before it (a copy from pageable memory would)
        host = torch.tensor([batch_slots, [t.numel() for t in batch]], pin_memory=dev.type == "cuda")
        slot_len = host.to(dev, non_blocking=True)
        slots = torch.repeat_interleave(slot_len[0], slot_len[1], output_size=batch_len)
        values = torch.cat([t.to(torch.float64) if not t.is_complex() else torch.view_as_real(t).reshape(-1).double()
                            for t in batch])
        signs = _constants.get(dev, _chunk_len(dev))[1]
        hashes.index_add_(0, slots.to(device), _mix(ints, offset).to(device))
        sketches.index_add_(0, slots.to(device), (values * signs[: values.numel()]).to(device))
        offset += ints.numel()
        batch.clear()
        batch_slots.clear()
        batch_len = 0

    for i, t in enumerate(tensors):
        flat = t.reshape(-1)
        chunk = _chunk_len(flat.device)
        slot = i % SLOTS
        if flat.numel() >= chunk // 4:  # large: alone, in chunks
            flush()
            ints = _as_ints(flat)
            values = torch.view_as_real(flat).reshape(-1) if flat.is_complex() else flat
            signs = _constants.get(flat.device, chunk)[1]
            h = torch.zeros((), dtype=torch.int64, device=flat.device)
            s = torch.zeros((), dtype=torch.float64, device=flat.device)
            for start in range(0, ints.numel(), chunk):
                h += _mix(ints[start:start + chunk], offset + start).sum()
                s += _projection(values[start:start + chunk], signs)
            offset += ints.numel()
            hashes[slot] += h.to(device)
            sketches[slot] += s.to(device)
            continue
        if batch and (batch[0].device != flat.device or batch_len + flat.numel() > chunk):
            flush()
        batch.append(flat)
        batch_slots.append(slot)
        batch_len += flat.numel()
    flush()
    return hashes, sketches


# --- the comparison -----------------------------------------------------------------------------
class RankSync(namedtuple("RankSync", "state step world_size ranks tensors differing size where sharded "
                                      "every seconds message")):
    """The outcome of one rank-sync check, the same on every rank.

    `state`: "in sync", "drift" or "not checked". `ranks`: the ranks whose parameters differ from
    rank 0's. `tensors`: trainable tensors compared; `differing`: how many differ (the most over
    the ranks; beyond 256 tensors, every tensor folded into a differing slot counts); `size`: the
    estimated L2 size of the largest rank's difference (inf for different parameter sets);
    `where`: the first differing parameter's name. `sharded`: trainable tensors left to a sharding
    engine. `every`: the interval (steps) the ranks agreed on for an automatic schedule.
    `seconds`: this rank's time for the check. `message`: one line of at most 100 characters, `str()`.
    """

    __slots__ = ()

    @property
    def ok(self) -> bool:
        """False only on drift."""
        return self.state != "drift"

    def __str__(self) -> str:
        return self.message


def _ranks_text(ranks) -> str:
    """1, 3-5, 9: ranges of consecutive ranks."""
    parts, run = [], []
    for r in list(ranks) + [None]:
        if run and (r is None or r != run[-1] + 1):
            parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
            run = []
        if r is not None:
            run.append(r)
    return ", ".join(parts)


def _world(group):
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_world_size(group)


def _unchecked(message: str, step, world: int, tensors: int, n_sharded: int, seconds: float) -> RankSync:
    return RankSync("not checked", step, world, (), tensors, 0, 0.0, None, n_sharded, None, seconds, fit(message))


def check_rank_sync(model, step: int | None = None, group=None, *, step_seconds: float | None = None,
                    previous_seconds: float = 0.0) -> RankSync:
    """Compare the trainable parameters that every rank holds whole across ranks: one all_gather.

    Call it on every rank at the same point (it is a collective), e.g. after `optimizer.step()`.
    `model`: the module (DDP-wrapped or not); `step`: named in the message; `group`: a
    torch.distributed group (default: the world). Returns a `RankSync` whose `str()` is a line
    such as "in sync (2 ranks, 12 tensors, step 40)" or "DRIFT: rank(s) 1 differ from rank 0 at
    step 40: 1/12 tensors, ~1.0e-03, model.layers.0.mlp.up_proj.weight". Without an initialized
    process group, or with one process, nothing is compared ("not checked: ...").
    `step_seconds` (the callback's measured step time) makes the ranks agree on the interval
    that keeps the check under 0.5% of it, in `every`, from this check's local time or
    `previous_seconds` (the last check's whole time, collective included), whichever is larger.
    """
    import torch
    import torch.distributed as dist

    started = time.perf_counter()
    names, tensors, n_sharded = replicated_trainable(model)
    world = _world(group)
    where = f" at step {step}" if step is not None else ""
    if world is None:
        from .topology_resolver import topology

        try:
            procs = topology().world_size
        except Exception:  # a bad variable is reported where a decision needs it
            procs = 1
        if procs > 1:
            return _unchecked(f"not checked: {procs} processes but no process group (each trains alone?)",
                              step, procs, len(names), n_sharded, time.perf_counter() - started)
        return _unchecked("not checked: one process", step, 1, len(names), n_sharded, time.perf_counter() - started)
    if world == 1:
        return _unchecked("not checked: one process", step, 1, len(names), n_sharded, time.perf_counter() - started)

    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(backend) else torch.device("cpu")
    hashes, sketches = digest_tensors(tensors, device=device)
    local = max(time.perf_counter() - started, previous_seconds)
    proposal = auto_every(local, step_seconds)
    header = torch.tensor([len(names), n_sharded, proposal, -1 if step is None else step],
                          dtype=torch.int64, device=device)
    payload = torch.cat([header, hashes, sketches.view(torch.int64)])
    gathered = [torch.empty_like(payload) for _ in range(world)]
    dist.all_gather(gathered, payload, group=group)
    table = torch.stack(gathered).cpu()
    heads, hash_rows = table[:, :HEADER], table[:, HEADER:HEADER + SLOTS]
    sketch_rows = table[:, HEADER + SLOTS:].contiguous().view(torch.float64)
    every = int(heads[:, 2].max())
    seconds = time.perf_counter() - started

    drifted, differing, size, first = [], 0, 0.0, None
    for r in range(1, world):
        if int(heads[r, 0]) != int(heads[0, 0]):  # different parameter sets: every slot is suspect
            drifted.append(r)
            differing = max(differing, max(int(heads[r, 0]), int(heads[0, 0])))
            size = math.inf
            continue
        bad = (hash_rows[r] != hash_rows[0]).nonzero().flatten().tolist()
        if bad:
            drifted.append(r)
            differing = max(differing, sum(len(range(s, len(names), SLOTS)) for s in bad))
            gap = float((sketch_rows[r, bad] - sketch_rows[0, bad]).norm())
            size = max(size, gap)
            first = names[bad[0]] if first is None or bad[0] < names.index(first) else first
    shards = f"; {n_sharded} sharded: the engine's" if n_sharded else ""
    if not drifted:
        at = f", step {step}" if step is not None else ""
        message = f"in sync ({world} ranks, {len(names)} tensors{at}{shards})"
        return RankSync("in sync", step, world, (), len(names), 0, 0.0, None, n_sharded, every, seconds,
                        fit(message))
    head = f"DRIFT: rank(s) {_ranks_text(drifted)} differ from rank 0{where}: "
    if size == math.inf:
        detail = f"different parameter sets ({int(heads[0, 0])} tensors on rank 0)"
    else:
        detail = f"{differing}/{len(names)} tensors, ~{size:.1e}"
        if first is not None:
            room = 100 - len(head) - len(detail) - 2
            name = first
            for wrapper in ("module.", "_orig_mod.", "base_model.model.", "model."):  # wrappers' prefixes
                if len(name) > room and name.startswith(wrapper):
                    name = name[len(wrapper):]
            while len(name) > room and "." in name.strip("."):  # drop leading components: the leaf names it
                name = "..." + name.lstrip(".").split(".", 1)[1]
            if len(name) <= room:
                detail += ", " + name
    return RankSync("drift", step, world, tuple(drifted), len(names), differing, size, first, n_sharded, every,
                    seconds, fit(head + detail))
