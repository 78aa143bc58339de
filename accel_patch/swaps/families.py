"""What the swap knows about model families, as data.

Nothing here decides a swap on its own: a module becomes a candidate by its structure (the
tables say which attribute names and activations to look for) and is swapped only after the
probe (probe.py) shows that the kernel computes the module's own function. A family nobody
listed works on day one when it uses these shapes; one that looks alike but computes something
else is refused by the probe, with the reason.
"""
from __future__ import annotations

#: Op names accepted by `swap_kernels(ops=...)` and ACCEL_PATCH_KERNELS, in report order.
OPS = ("rms_norm", "layer_norm", "rope", "glu", "fused_linear_cross_entropy", "lora_mlp", "lora_qkv", "lora_o", "tiled_mlp",
       "experts")
#: Other spellings users write for the same op.
OP_ALIASES = {"swiglu": "glu", "geglu": "glu", "flce": "fused_linear_cross_entropy",
              "cross_entropy": "fused_linear_cross_entropy", "rmsnorm": "rms_norm", "layernorm": "layer_norm",
              "tiled": "tiled_mlp", "moe": "experts", "moe_experts": "experts"}
#: Names that stand for several ops.
OP_GROUPS = {"lora": ("lora_mlp", "lora_qkv", "lora_o")}


def expand(name: str) -> tuple[str, ...]:
    """The op names one name the user wrote stands for (an alias or a group), unchecked."""
    return OP_GROUPS.get(name) or (OP_ALIASES.get(name, name),)

# --- RMSNorm -------------------------------------------------------------------------------
#: Attribute that holds a norm's epsilon (LlamaRMSNorm: variance_epsilon; Gemma, torch: eps).
NORM_EPS_ATTRIBUTES = ("variance_epsilon", "eps", "epsilon")
#: (casting, offset) variants the probe tries, most common first: Llama (w * norm(x) cast back),
#: Gemma ((1 + w) in fp32), Olmo2 / fp32-affine (w in fp32, offset 0), all-in-dtype.
NORM_VARIANTS = (("llama", 0.0), ("gemma", 1.0), ("gemma", 0.0), ("none", 0.0), ("llama", 1.0))
#: Variants of a norm without a weight (Gemma 4's value norm, Llama 4's L2 norm, DeepSeek V4's):
#: norm in fp32 cast back (Llama's and Gemma's forms are one there), all-in-dtype.
NORM_WEIGHTLESS_VARIANTS = (("gemma", 0.0), ("none", 0.0))
#: Gates of the gated forms: `norm(x) * act(gate)` (linear-attention output norms) with silu or
#: sigmoid, and `norm(x * silu(gate))` ("pre_silu": Mamba2's, the gate before normalizing).
NORM_GATE_ACTIVATIONS = ("silu", "sigmoid", "pre_silu")
#: Attributes that change a norm's function within one class: part of the probe's cache key.
NORM_FORM_ATTRIBUTES = ("activation", "norm_before_gate", "group_size", "n_groups", "with_scale")

# --- gated MLP -----------------------------------------------------------------------------
#: (gate, up, down) child names of a split gated MLP.
GLU_SPLIT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
#: (fused gate+up, down) child names of a fused gated MLP (Phi3, GLM; Granite's shared MLP in
#: GraniteMoeShared / GraniteMoeHybrid / Granite 4: `input_linear`, `output_linear`); the probe
#: finds the order.
GLU_FUSED_NAMES = (("gate_up_proj", "down_proj"), ("input_linear", "output_linear"))
#: (up, down) child names of a non-gated MLP, `down(act(up(x)))` (Nemotron-H's ReLU², Apertus's
#: xIELU). The tiled MLP tiles it; glu runs the activations of PLAIN_ACTIVATION_NAMES in a kernel
#: and refuses the others, naming the form.
MLP_PLAIN_NAMES = (("up_proj", "down_proj"),)
#: A non-gated MLP's activation, by class or function name (lower case) -> its kernel ("relu2":
#: accel_kernels.relu_squared). The probe then checks that it computes that.
PLAIN_ACTIVATION_NAMES = {"relusquaredactivation": "relu2", "relu2": "relu2", "relu_squared": "relu2"}
#: Attribute that holds the MLP's activation (Granite's shared MLP: `activation`).
ACTIVATION_ATTRIBUTES = ("act_fn", "activation_fn", "act", "activation")
#: torch.nn.functional activations a gated MLP may call in its forward instead of holding one
#: (LFM2, LFM3: `F.silu(self.w1(x)) * self.w3(x)`).
INLINE_ACTIVATIONS = ("silu", "gelu")
#: What an activation says it is, by class or function name (lower case) -> the kernel's
#: activation: "silu" (swiglu), "gelu" (geglu, erf), "gelu_tanh" (geglu, tanh). The probe then
#: checks that it computes that; a name not listed here has no kernel.
ACTIVATION_NAMES = {
    "silu": "silu", "siluactivation": "silu", "swish": "silu",
    "gelu": "gelu", "geluactivation": "gelu",
    "gelutanh": "gelu_tanh", "pytorchgelutanh": "gelu_tanh", "newgeluactivation": "gelu_tanh",
    "fastgeluactivation": "gelu_tanh", "accurategeluactivation": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
}

#: Attributes (of the module, else of its configuration) that clamp pre-activations: DeepSeek V4's
#: and GLM-5-next's `swiglu_limit`, gpt-oss's `limit`. The probe drives inputs past them.
LIMIT_ATTRIBUTES = ("limit", "swiglu_limit", "clamp_limit")
#: How far the past-limits probe drives pre-activations (the largest |gate/up| over its rows): PAST_LIMIT
#: times the largest limit named, and at least UNNAMED_REACH, so a clamp below it that nobody listed
#: is still seen. One rule for the dense MLP's probe and the experts'.
PAST_LIMIT, UNNAMED_REACH = 4.0, 40.0

# --- fused LoRA (lora/) -----------------------------------------------------------------
#: Input projections of an attention block, one group read from the same x (q/k/v or fused).
LORA_ATTENTION_INPUTS = (("q_proj", "k_proj", "v_proj"), ("qkv_proj",), ("query_key_value",))
#: Its output projection.
LORA_ATTENTION_OUTPUTS = ("o_proj", "dense", "out_proj")

# --- MoE experts (experts/) ----------------------------------------------------------------
#: (gate_up, down) 3-D parameter names of an experts module (transformers' `use_experts_implementation`
#: classes, Llama4's); the probe finds the layout ([E, 2I, H] or [E, H, 2I]) and the gate/up order.
EXPERTS_NAMES = (("gate_up_proj", "down_proj"),)
#: Separate 3-D gate/up/down parameters: experts of that shape exist outside transformers; the op
#: takes one gate_up, so they are refused with the reason rather than concatenated at every call.
EXPERTS_SPLIT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
#: Optional biases of the two projections (gpt-oss).
EXPERTS_BIAS_SUFFIX = "_bias"

# --- RoPE ----------------------------------------------------------------------------------
#: Module-level functions that attention forwards call by name to apply rotate-half RoPE.
ROPE_FUNCTIONS = ("apply_rotary_pos_emb",)
#: Interleaved-RoPE functions (DeepSeek V3's MLA and its heirs), intercepted like the rotate-half
#: one; an MLA attention that names both calls this one unless its `rope_interleave` is False.
INTERLEAVED_ROPE_FUNCTIONS = ("apply_rotary_pos_emb_interleave", "apply_rotary_emb_interleave")
#: Complex-number RoPE functions (Llama 4's and DeepSeek V2's `apply_rotary_emb(xq, xk, freqs_cis)`),
#: intercepted where a forward names no other: the kernel's "complex" form, on the table's real view.
COMPLEX_ROPE_FUNCTIONS = ("apply_rotary_emb",)
#: Config attributes that give the rotary share of a head (partial rotary).
PARTIAL_ROTARY_ATTRIBUTES = ("partial_rotary_factor", "rotary_pct")

# --- refusals worth naming -----------------------------------------------------------------
#: Class-name fragments of mean-centred norms (LayerNorm): the layer_norm op's sites, not rms_norm's.
LAYER_NORM_MARKERS = ("layernorm", "layer_norm")
