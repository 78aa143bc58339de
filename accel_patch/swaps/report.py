"""What a swap did: `SwapReport`, readable by people (`str()`) and by code (`.swapped`, `.refused`).

Pure Python (no torch): `accel_patch` imports it at import time.
"""
from __future__ import annotations

from collections import namedtuple

from .families import OPS


class Refusal(namedtuple("Refusal", "where op reason")):
    """A site that was not swapped: module path (or function), op, and why."""

    __slots__ = ()


class SwapReport:
    """The kernels swapped into one model instance and the sites refused.

    `swapped`: op name -> number of sites now running the kernel (ops with none are absent).
    `refused`: one `Refusal(where, op, reason)` per site left as stock.
    `model`: the class name of the model swapped. `new`: sites swapped by this call (0 when the
    model already had them: swapping twice swaps nothing twice). `head`: when a trainer installed
    its own LM head on the model (TRL's `add_fused_lm_head`), whose head runs its training calls:
    "TRL's", or "accel-patch's fused loss in TRL's place"; None otherwise.
    `calls`: for the ops decided at each call (the fused LoRA sites), op -> outcome -> number of
    calls so far ("fused", or which other forward ran and why); live: it grows as the model runs.
    """

    def __init__(self, model: str, swapped: dict[str, int] | None = None,
                 refused: list[Refusal] | None = None, new: int = 0, head: str | None = None,
                 calls: dict[str, dict[str, int]] | None = None) -> None:
        self.model = model
        self.swapped = dict(swapped or {})
        self.refused = list(refused or [])
        self.new = new
        self.head = head
        self.calls = calls if calls is not None else {}

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
        if self.head:
            line += f"; LM head: {self.head}"
        return line

    def short(self) -> str:
        """Sites per op and how many were refused, short enough for a logged value (< 100 chars)."""
        ordered = sorted(self.swapped.items(), key=_op_order)
        parts = [f"{op} {n}" for op, n in ordered if not op.startswith("lora_") and op != "tiled_mlp"]
        tiled = self.swapped.get("tiled_mlp")
        if tiled:  # with glu ("glu+tiled 32"): a 32-layer model's line stays under 100 chars
            at = next((i for i, p in enumerate(parts) if p.startswith("glu ")), None)
            if at is not None and self.swapped["glu"] == tiled:
                parts[at] = f"glu+tiled {tiled}"
            else:
                parts.insert(len(parts) if at is None else at + 1, f"tiled {tiled}")
        lora = " ".join(f"{op[len('lora_'):]} {n}" for op, n in ordered if op.startswith("lora_"))
        if lora:  # the three LoRA sites in one part: a 32-layer model's line stays under 100 chars
            parts.append(f"lora {lora}")
        done = ", ".join(parts) or "nothing swapped"
        head = {None: "", "TRL's": "; LM head: TRL's"}.get(self.head, "; LM head: ours, in TRL's place")
        return done + (f"; {len(self.refused)} refused" if self.refused else "") + head

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
        if len(rows) == 1:
            rows.append(("-", "0", "", "no candidate site found"))
        for op, outcomes in sorted(self.calls.items(), key=_op_order):
            for outcome, n in sorted(outcomes.items()):
                rows.append((op, str(n), "calls", outcome))
        w0, w1, w2 = (max(len(r[i]) for r in rows) for i in range(3))
        head = f"kernel swap report for {self.model}"
        return "\n".join([head] + [f"  {a:<{w0}}  {b:>{w1}}  {c:<{w2}}  {d}".rstrip() for a, b, c, d in rows])

    def to_dict(self) -> dict:
        return {"model": self.model, "swapped": dict(self.swapped),
                "refused": [r._asdict() for r in self.refused], "head": self.head,
                "calls": {op: dict(outcomes) for op, outcomes in self.calls.items()}}


def _op_order(item) -> int:
    op = item[0]
    return OPS.index(op) if op in OPS else len(OPS)
