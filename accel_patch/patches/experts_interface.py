"""The experts-interface patch: `experts_implementation="accel_patch"` in transformers.

Target `transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS` (the `ExpertsInterface` that
transformers' `use_experts_implementation` classes dispatch through), verified on transformers
5.17 and 5.24. Adds the entry `accel_patch` (swaps/experts/interface.py: the swap's experts site,
made on a module's first call), so `from_pretrained(..., experts_implementation="accel_patch")`,
`config._experts_implementation = "accel_patch"` and `model.set_experts_implementation(
"accel_patch")` run the experts op the way transformers documents. Undo: the entry is deleted.
"""
from __future__ import annotations

from ..core import registry

SWITCH = "ACCEL_PATCH_EXPERTS_INTERFACE"


class ExpertsInterfacePatch(registry.Patch):
    name = "experts-interface"
    module = "transformers.integrations.moe"
    target = "transformers' ExpertsInterface: experts_implementation=\"accel_patch\" runs accel-patch's experts op"
    verified = "transformers 5.17, 5.24"
    switch = SWITCH
    pending = "binds when transformers.integrations.moe is imported (a MoE model's modeling module imports it)"

    def __init__(self) -> None:
        super().__init__()
        self._interface = None  # the ExpertsInterface the entry was added to

    @property
    def installed(self) -> bool:
        return self._interface is not None

    def check(self, module) -> str | None:
        interface = getattr(module, "ALL_EXPERTS_FUNCTIONS", None)
        if interface is None or not hasattr(type(interface), "__setitem__"):
            return f"transformers.integrations.moe has no ExpertsInterface to register in (verified on {self.verified})"
        return None

    def install(self, module) -> None:
        from ..swaps.experts import interface

        module.ALL_EXPERTS_FUNCTIONS[interface.NAME] = interface.experts_forward
        self._interface = module.ALL_EXPERTS_FUNCTIONS

    def uninstall(self) -> None:
        from ..swaps.experts import interface

        registered = getattr(self, "_interface", None)
        if registered is not None and interface.NAME in getattr(registered, "_local_mapping", {}):
            del registered[interface.NAME]
        self._interface = None
        super().uninstall()


patch = ExpertsInterfacePatch()
registry.register(patch)
