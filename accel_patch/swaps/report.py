"""What a swap did: `SwapReport`, readable by people (`str()`) and by code (`.swapped`, `.refused`,
`.calls`), and what a call's outcome means (`outcome_kind`).

Pure Python (no torch): `accel_patch` imports it at import time.
"""
from __future__ import annotations

from collections import namedtuple

from ..core.log_line import fit
from .families import OPS

# --- outcomes of the ops decided per call (SwapReport.calls) ------------------------------------
#: A call that ran the kernel: its outcome is one of these words, alone or followed by a note in
#: parentheses ("fused", "fused (in TRL's head)", "tiled").
SUCCESSES = ("fused", "tiled")
#: Another forward ran by design, so nothing fell back: an outcome starting with one of these.
#: Nothing for the kernel to do (a LoRA site whose adapters are all disabled, e.g. DPO's reference
#: pass; TRL's head in evaluation mode, which the model's own fused loss does not count either), or
#: stock is the faster choice (the fused loss's small logits on CPU without Triton: loss/site.py).
#: The tiled MLP pays only for long sequences in training (swaps/layers/tiled_mlp.py): a short sequence, a
#: call without grad or in eval mode runs the forward beneath by design, and so does a call that is
#: not checkpointed ("not checkpointed") unless the op was asked for by name. A LoRA site at a decode
#: step (a few tokens, no grad: generation) runs PEFT's forward, the faster path there (lora/sites.py),
#: and so does a LoRA call of a shape where PEFT's forward was timed faster (lora/timing.py).
BY_DESIGN = ("no active LoRA adapter", "TRL's head: evaluation mode", "stood aside: small logits on CPU",
             "stood aside: no Triton",
             "short sequence", "no grad", "eval mode", "not checkpointed", "decode shape", "faster unfused",
             "the user's choice")
#: The fused loss's op name (sites.LOSS_OP; this module imports no torch).
LOSS_OP = "fused_linear_cross_entropy"
#: Prefix of an outcome counted while torch.compile traces a site (once per compiled graph, not per
#: call: swaps/lora/sites.py); what follows it is classified like any outcome.
COMPILED = "compiled: "


def outcome_kind(outcome: str) -> str:
    """"success" (the kernel ran), "by design" (another forward ran where it should) or "fall-back"
    (another forward ran where the kernel would have: every other outcome, e.g. "PEFT's forward:
    <reason>", "stood aside: a LoRA adapter on the LM head ..."). The one rule the report, the
    Trainer callback's logs and the tests read."""
    if outcome.startswith(COMPILED):
        return outcome_kind(outcome[len(COMPILED):])
    if any(outcome == s or outcome.startswith(s + " (") for s in SUCCESSES):
        return "success"
    if outcome.startswith(BY_DESIGN):
        return "by design"
    return "fall-back"


def is_fallback(outcome: str) -> bool:
    return outcome_kind(outcome) == "fall-back"


def calls_snapshot(calls: dict[str, dict[str, int]]) -> dict[tuple[str, str], int]:
    """The counts of a live `calls` table now, for `fallbacks_since`."""
    return {(op, outcome): n for op, outcomes in list(calls.items()) for outcome, n in list(outcomes.items())}


def fallbacks_since(calls: dict[str, dict[str, int]], before: dict[tuple[str, str], int]) -> list[tuple[str, str, int]]:
    """(op, outcome, calls) of every fall-back outcome counted since the snapshot `before`, most first."""
    now = calls_snapshot(calls)
    grown = [(op, outcome, n - before.get((op, outcome), 0)) for (op, outcome), n in now.items()
             if is_fallback(outcome) and n > before.get((op, outcome), 0)]
    return sorted(grown, key=lambda item: (-item[2], _op_order(item)))


def fallback_line(items: list[tuple[str, str, int]]) -> str:
    """The fall-backs in one logged value (<= 100 characters): "lora_mlp x8 PEFT's forward: a LoRA
    variant (DoRA); +1 more": the op, how many calls, why; the rest is in the report."""
    parts = [f"{op} x{n} {outcome}" for op, outcome, n in items]
    line = parts[0] if parts else ""
    for i, part in enumerate(parts[1:], 1):
        more = len(parts) - i - 1
        candidate = f"{line}; {part}"
        if len(candidate) + (len(f"; +{more} more") if more else 0) > 100:
            return fit(line, 100 - len(f"; +{len(parts) - i} more")) + f"; +{len(parts) - i} more"
        line = candidate
    return fit(line)


class Refusal(namedtuple("Refusal", "where op reason")):
    """A site that was not swapped: module path (or function), op, and why."""

    __slots__ = ()


class SwapReport:
    """The kernels swapped into one model instance and the sites refused.

    `swapped`: op name -> number of sites now running the kernel (ops with none are absent).
    `refused`: one `Refusal(where, op, reason)` per site left as stock.
    `model`: the class name of the model swapped. `new`: sites swapped by this call (0 when the
    model already had them: swapping twice swaps nothing twice). `head`: when a trainer installed
    its own LM head on the model (TRL's `add_fused_lm_head`), whose head was installed there:
    "TRL's", or "accel-patch's fused loss in TRL's place"; None otherwise. Whose head ran its
    calls is `head_ran()`, by the counted calls (ours stands aside per call where TRL's options
    need its own), and is what `summary()`, `short()` and `to_dict()["head"]` say
    (`to_dict()["head_installed"]` is `head`).
    `calls`: for the ops decided at each call (the fused loss, the fused LoRA sites, any op that
    pays only at some shapes), op -> outcome -> number of calls so far ("fused", or which other
    forward ran and why: `outcome_kind`); live: it grows as the model runs. Under torch.compile the
    compiled graph decides and calls are not counted.
    `waiting`: LoRA sites installed on modules that have no PEFT LoRA layer yet, op -> sites: not
    counted in `swapped` (nothing is fused there) until an adapter is added.
    `replaced`: (where, op, by whom) of sites whose swapped forward was rebound after the swap by
    something that does not call it (another tool's kernels): not counted in `swapped`.
    `mixers`: linear-attention and SSM mixers, which no accel-patch op covers: class name ->
    (modules, what transformers runs there: its torch reference or the package's kernels;
    swaps/mixers.py).
    `not_run`: ops decided per call whose calls so far all ran another function (none ran the
    kernel, some fell back: `outcome_kind`), op -> sites; live like `calls`. Such an op is not in
    `swapped`: its forward is installed, but what ran there is stock.
    """

    def __init__(self, model: str, swapped: dict[str, int] | None = None,
                 refused: list[Refusal] | None = None, new: int = 0, head: str | None = None,
                 calls: dict[str, dict[str, int]] | None = None, waiting: dict[str, int] | None = None,
                 mixers: dict[str, tuple[int, str]] | None = None,
                 replaced: list[tuple[str, str, str]] | None = None) -> None:
        self.model = model
        self.mixers = dict(mixers or {})
        self.replaced = list(replaced or [])
        gone: dict[str, int] = {}
        for _, op, _ in self.replaced:
            gone[op] = gone.get(op, 0) + 1
        self.waiting = {op: n for op, n in (waiting or {}).items() if n}
        self._installed = {op: n - self.waiting.get(op, 0) - gone.get(op, 0) for op, n in (swapped or {}).items()
                           if n - self.waiting.get(op, 0) - gone.get(op, 0) > 0}
        self.refused = list(refused or [])
        self.new = new
        self.head = head
        self.calls = calls if calls is not None else {}

    @property
    def swapped(self) -> dict[str, int]:
        """op -> sites running its kernel: installed, less the ops whose every call so far fell back."""
        not_run = self.not_run
        return {op: n for op, n in self._installed.items() if op not in not_run}

    @property
    def not_run(self) -> dict[str, int]:
        """op -> sites installed for an op whose counted calls all ran another function (see the class)."""
        return {op: n for op, n in self._installed.items() if _never_ran(self.calls.get(op))}

    def _not_run_why(self, op: str) -> str:
        """The most common fall-back of a not-run op (what ran instead, and why)."""
        outcomes = [(n, o) for o, n in self.calls.get(op, {}).items() if is_fallback(o)]
        return max(outcomes)[1] if outcomes else ""

    def __bool__(self) -> bool:
        return bool(self.swapped)

    def __repr__(self) -> str:
        return f"SwapReport(model={self.model!r}, swapped={self.swapped!r}, refused={len(self.refused)} site(s))"

    def summary(self) -> str:
        """One line: what was swapped and what was refused (the log line)."""
        done = ", ".join(f"{op} {n}" for op, n in sorted(self.swapped.items(), key=_op_order)) or "nothing"
        line = f"{self.model}: swapped {done}"
        if self.refused:
            groups = self._grouped()
            line += "; refused " + "; ".join(f"{op} x{len(sites)} ({reason})" for (op, reason), sites in groups)
        for op, n in sorted(self.not_run.items(), key=_op_order):
            line += f"; not run {op} x{n} (every call fell back: {self._not_run_why(op)})"
        if self.waiting:
            line += "; waiting for LoRA adapters: " + ", ".join(
                f"{op} {n}" for op, n in sorted(self.waiting.items(), key=_op_order))
        if self.head:
            line += f"; LM head: {self.head_ran()}"
        for (op, by), wheres in self._replaced_groups():
            line += f"; {op} x{len(wheres)} replaced after the swap by {by} (its forward runs, not ours)"
        for cls, (n, what) in sorted(self.mixers.items()):
            line += f"; mixer {cls} x{n} (no accel-patch op): {what}"
        return line

    #: The head line while no call asked for TRL's head: a trainer that installs it (SFT's __init__)
    #: whose own loss never calls it (trl.experimental's GKD).
    HEAD_NOT_CALLED = "ours, never called"

    def head_ran(self) -> str | None:
        """Whose LM head ran the calls of a trainer's own head (TRL's), by the counted calls: ours in
        TRL's place, TRL's where ours stood aside (the fall-backs say why), or both, with how often."""
        if self.head is None:
            return None
        if self.head == "TRL's":
            return "TRL's"
        calls = self.calls.get(LOSS_OP, {})
        ours = sum(n for o, n in calls.items() if o.startswith("fused (in TRL's head"))
        trls = sum(n for o, n in calls.items() if o.startswith("TRL's head:") and outcome_kind(o) == "fall-back")
        if trls and not ours:
            return "TRL's (ours stood aside, see fall-backs)"
        if trls:
            return f"ours, TRL's in {trls} of {ours + trls} calls"
        if not ours:  # installed, but no call asked for TRL's head (GKD's loss never does)
            return self.HEAD_NOT_CALLED
        return "ours, in TRL's place"

    def short(self) -> str:
        """Sites per op and how many were refused, short enough for a logged value (<= 100 chars)."""
        ordered = sorted(self.swapped.items(), key=_op_order)
        said = self.head_ran()
        head = f"; LM head: {said}" if said else ""
        # installed, but no call so far ran the kernel and some ran another function: the line
        # does not claim the op (`swapped` leaves it out) and says so
        not_run = [_SHORT_NAMES.get(op, op) for op, _ in sorted(self.not_run.items(), key=_op_order)
                   if not op.startswith("lora_")]
        loras_not_run = [op[len("lora_"):] for op in sorted(self.not_run, key=lambda op: _op_order((op, 0)))
                         if op.startswith("lora_")]
        if loras_not_run:  # "lora mlp/qkv/o", as the swapped LoRA sites are written
            not_run.append("lora " + "/".join(loras_not_run))
        if not_run:
            head += f"; {', '.join(not_run)}: not run (see fall-backs)"
        tail = (f"; {len(self.refused)} refused" if self.refused else "") + head
        if self.replaced:
            tail += f"; {len(self.replaced)} replaced after the swap"
        if self.mixers:  # what runs there: the report's mixer rows; the reference is what users must know
            slow = sum(n for n, what in self.mixers.values() if "torch reference" in what)
            total = sum(n for n, _ in self.mixers.values())
            tail += f"; mixers {total}: " + ("torch reference" if slow == total else
                                             f"{slow} torch reference" if slow else "package kernels")
        line = ""
        for names in ({}, _SHORT_NAMES):  # the ops' own names, then shorter ones if the line is too long
            parts = [f"{names.get(op, op)} {n}" for op, n in ordered if not op.startswith("lora_") and op != "tiled_mlp"]
            tiled = self.swapped.get("tiled_mlp")
            if tiled:  # with glu ("glu+tiled 32"): a 32-layer model's line stays short
                at = next((i for i, p in enumerate(parts) if p.startswith("glu ")), None)
                if at is not None and self.swapped["glu"] == tiled:
                    parts[at] = f"glu+tiled {tiled}"
                else:
                    parts.insert(len(parts) if at is None else at + 1, f"tiled {tiled}")
            loras = [(op[len("lora_"):], n) for op, n in ordered if op.startswith("lora_")]
            if names and len({n for _, n in loras}) == 1:  # short form: "lora mlp/qkv/o 32"
                parts.append("lora " + "/".join(op for op, _ in loras) + f" {loras[0][1]}")
            elif loras:  # the three LoRA sites in one part: a 32-layer model's line stays short
                parts.append("lora " + " ".join(f"{op} {n}" for op, n in loras))
            line = (", ".join(parts) or "nothing swapped") + tail
            if len(line) <= 100:
                return line
        return fit(line)

    def _replaced_groups(self) -> list[tuple[tuple[str, str], list[str]]]:
        groups: dict[tuple[str, str], list[str]] = {}
        for where, op, by in self.replaced:
            groups.setdefault((op, by), []).append(where)
        return sorted(groups.items(), key=lambda kv: _op_order((kv[0][0], 0)))

    def _grouped(self) -> list[tuple[tuple[str, str], list[str]]]:
        groups: dict[tuple[str, str], list[str]] = {}
        for r in self.refused:
            groups.setdefault((r.op, r.reason), []).append(r.where)
        return sorted(groups.items(), key=lambda kv: _op_order((kv[0][0], 0)))

    def __str__(self) -> str:
        rows = [("op", "sites", "state", "where / why")]
        for op, n in sorted(self.swapped.items(), key=_op_order):
            rows.append((op, str(n), "swapped", ""))
        for (op, reason), sites in self._grouped():
            where = ", ".join(sites[:2]) + (f", ... (+{len(sites) - 2})" if len(sites) > 2 else "")
            rows.append((op, str(len(sites)), "refused", f"{where}: {reason}"))
        for op, n in sorted(self.not_run.items(), key=_op_order):
            rows.append((op, str(n), "not run", f"installed, but every call so far ran another function: "
                                                f"{self._not_run_why(op)}"))
        for op, n in sorted(self.waiting.items(), key=_op_order):
            rows.append((op, str(n), "waiting", "no LoRA adapter on these modules yet: fused once PEFT adds one"))
        for (op, by), wheres in self._replaced_groups():
            where = ", ".join(wheres[:2]) + (f", ... (+{len(wheres) - 2})" if len(wheres) > 2 else "")
            rows.append((op, str(len(wheres)), "replaced", f"{where}: rebound after the swap by {by}; its forward runs"))
        for cls, (n, what) in sorted(self.mixers.items()):
            rows.append(("mixer", str(n), "stock", f"{cls} (no accel-patch op): {what}"))
        if len(rows) == 1:
            rows.append(("-", "0", "", "no candidate site found"))
        for op, outcomes in sorted(self.calls.items(), key=_op_order):
            for outcome, n in sorted(outcomes.items()):
                rows.append((op, str(n), "calls", f"{outcome}" + (" (fall-back)" if is_fallback(outcome) else "")))
        w0, w1, w2 = (max(len(r[i]) for r in rows) for i in range(3))
        head = f"kernel swap report for {self.model}"
        return "\n".join([head] + [f"  {a:<{w0}}  {b:>{w1}}  {c:<{w2}}  {d}".rstrip() for a, b, c, d in rows])

    def to_dict(self) -> dict:
        return {"model": self.model, "swapped": dict(self.swapped), "not_run": dict(self.not_run),
                "refused": [r._asdict() for r in self.refused], "head": self.head_ran(),
                "head_installed": self.head,
                "waiting": dict(self.waiting), "calls": {op: dict(outcomes) for op, outcomes in self.calls.items()},
                "mixers": {cls: {"modules": n, "runs": what} for cls, (n, what) in self.mixers.items()},
                "replaced": [{"where": w, "op": op, "by": by} for w, op, by in self.replaced]}


#: Shorter names for a logged line that would otherwise pass 100 characters.
_SHORT_NAMES = {"fused_linear_cross_entropy": "loss", "rms_norm": "norm", "layer_norm": "ln"}


def _never_ran(outcomes: dict[str, int] | None) -> bool:
    """Calls were counted, none ran the kernel, and some fell back (by-design outcomes alone, such
    as no Triton on CPU, leave the op swapped: stock is the right choice there)."""
    kinds = {outcome_kind(o) for o, n in (outcomes or {}).items() if n}
    return "fall-back" in kinds and "success" not in kinds


def _op_order(item) -> int:
    op = item[0]
    return OPS.index(op) if op in OPS else len(OPS)
