"""Module kernels: sites that replace one decoder module's forward with an accel_kernels op.

    norms.py       RMSNorm (plain and Gemma's (1 + w)), per head (q/k norms) or whole; LayerNorm
                   (op layer_norm)
    mlp.py         the gated MLP (split gate/up/down or fused gate_up; SiLU or GELU): the GLU op
    rope.py        rotary embeddings: the family's apply_rotary_pos_emb, intercepted per model
    tiled_mlp.py   a long call of a gated MLP run chunk by chunk over the tokens (on top of
                   whatever forward the MLP has: stock, the GLU kernel or fused LoRA)
    mixers.py      linear-attention and SSM mixers: no op, named in the report with what runs there

Each file has one shape: the candidate test (by structure), the probe verdict (by numbers), the
swapped forward. The walk that calls them is swaps/apply.py. These modules import the shared
machinery of swaps/ (sites, probe, families) and accel_kernels, never another room's modules.
"""
