"""The LM head and its loss: the full logits are never built when only a loss or per-token
log-probs are wanted.

    site.py            the swapped model forward, its candidate test and probe (the site)
    head.py            which linear layer a call fuses, and whether its weight is whole (FSDP, ZeRO-3)
    deferred.py        the deferred logits: the head call, the rules (one table), the fused loss on
                       them, and DeferredLogits, their carrier in eager mode (a tensor subclass)
    compiled_loss.py   LogitsStandIn, their carrier while torch.compile traces (a plain object
                       dynamo follows, reading the same rules), and the compiled call around it
    token_logprobs.py  per-token log-probs and TRL's metrics from the head's input, for TRL's heads

These modules import the shared machinery of swaps/ (sites, probe) and accel_kernels, never
another room's modules; patches/trl_fused_head.py calls into them for TRL's trainers.
"""
