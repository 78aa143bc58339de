"""Integrations: the ways into a user's program besides `import accel_patch`.

    callback.py           `AccelPatchCallback` for `transformers.Trainer` and TRL's trainers
    trainer_callbacks.py  its automatic registration (one per Trainer, at the head of the list):
                          a registry patch of `CallbackHandler`, kept beside the callback it adds
    config_entry.py       `accel-patch config`'s files: the settings beside accelerate's config
                          and the start-up `.pth` hook
    startup_gate.py       the stdlib-only code that hook runs at every interpreter start

Integrations import the core and swaps/, never patches/ or cli/ (what a patch decided is read
through `core.registry.last_decision`).
"""
