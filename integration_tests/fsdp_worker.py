"""One rank of the FSDP runs (integration_tests/test_fsdp.py): the swapped model against stock under
FSDP2 (`fully_shard`) and FSDP1 (`FullyShardedDataParallel`), on CPU with gloo, under torchrun.

For each mode it builds a tiny Llama (same weights on every rank), a copy with accel-patch's kernels
swapped in (before sharding, as the load hook and the Trainer callback do), shards both the same
way (each decoder layer, then the model: the head sits in the root's unit), trains both a few AdamW
steps on this rank's own batches, gathers the full weights, and writes to `<out>/fsdp_rank<R>.json`:
per mode the stock and swapped losses, the swapped model's loss calls (`SwapState.loss_calls`:
"fused", or why a call stood aside), the largest gathered-weight difference, and two yardsticks
trained in one process on every rank's data: stock FSDP's distance from stock there (FSDP's own
noise) and the swapped model's distance from stock there (the swap's own float32 noise). The
`checkpoint` mode saves FSDP's sharded state dict (torch.distributed.checkpoint) and, after
gathering, `save_pretrained`, for stock and swapped at the same weights, into `<out>/ckpt/`.

Modes: fsdp2-untied fsdp2-tied fsdp1-untied fsdp1-tied lora lora-head checkpoint (all by default), and
moe-ddp moe-fsdp2 moe-lora-fsdp2 when named: a tiny Qwen3-MoE (4 experts, top-2) with its experts
swapped, under DDP and under FSDP2 (the last with PEFT's rsLoRA on every linear and on the experts),
the same way, which also write the experts' call outcomes, the Triton kernels
launched while the swapped model trained, and (DDP) each rank's weight digest and `check_rank_sync`.

`--zero3 FILE` instead runs DeepSpeed ZeRO-3 in this one process (gloo; DeepSpeed must be
installed): a swapped and a stock tiny Llama, 2 SGD steps each, and writes what the head's weight
looked like and the loss calls to FILE.
"""
import accel_patch  # first, as a user's script would

import argparse
import copy
import hashlib
import json
import os

import torch
import torch.distributed as dist

VOCAB, SEQ, STEPS, LR = 128, 16, 3, 1e-2
MODES = ("fsdp2-untied", "fsdp2-tied", "fsdp1-untied", "fsdp1-tied", "lora", "lora-head", "checkpoint")
MOE_MODES = ("moe-ddp", "moe-fsdp2", "moe-lora-fsdp2")


def tiny(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=SEQ * 2, tie_word_embeddings=tied))


def tiny_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        max_position_embeddings=SEQ * 2, tie_word_embeddings=False))


def batches(rank: int):
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data: FSDP must reduce the grads
    for _ in range(STEPS):
        starts = torch.randint(0, VOCAB, (2, 1), generator=g)
        ids = (starts + torch.randint(1, 4, (2, 1), generator=g) * torch.arange(SEQ)) % VOCAB
        yield {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def fsdp2(model, layers):
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def fsdp1(model):
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    # device_id: FSDP1 looks for an accelerator otherwise ("FSDP needs a non-CPU accelerator device")
    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
                                    use_orig_params=True, device_id=torch.device("cpu"))


def gathered(model) -> dict:
    """The full weights, on rank 0 (an empty dict elsewhere)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        sd = {k: v.detach().float().clone() for k, v in model.module.named_parameters()}
        return sd if dist.get_rank() == 0 else {}
    if hasattr(model, "_fsdp_wrapped_module"):
        # FSDP1's full state dict segfaults on CPU here (torch 2.13, _state_dict_utils.param_hook):
        # read the parameters inside summon_full_params instead.
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            sd = {k.replace("_fsdp_wrapped_module.", ""): v.detach().float().clone()
                  for k, v in model.named_parameters()}
        return sd if dist.get_rank() == 0 else {}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().float().clone() for k, v in sd.items()}


def trainable_names(model):
    return sorted(n for n, p in model.named_parameters() if p.requires_grad)


def one_process_batches(world: int):
    """Every rank's batches at once: what one process trains on for the same global steps."""
    for parts in zip(*(batches(r) for r in range(world))):
        yield {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def train(model, rank, data=None):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR)
    losses = []
    for batch in data if data is not None else batches(rank):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def loss_calls(model):
    from accel_patch.swaps import sites

    for m in model.modules():
        state = m.__dict__.get(sites.STATE_ATTR)
        if state is not None:
            return dict(state.loss_calls)
    return None


def digest(sd) -> str:
    h = hashlib.sha256()
    for k in sorted(sd):
        h.update(k.encode())
        h.update(sd[k].numpy().tobytes())
    return h.hexdigest()[:16]


def pair(mode: str):
    """(stock, swapped, unsharded stock) for a mode, the first two sharded the same way."""
    if mode.startswith("moe"):
        stock = tiny_moe()
        swapped = copy.deepcopy(stock)
        report = accel_patch.swap_kernels(swapped)
        assert report.swapped.get("experts") == 2, str(report)
        if mode == "moe-lora-fsdp2":  # PEFT's rsLoRA on every linear, the experts' 3-D weights included
            from peft import LoraConfig, get_peft_model

            config = LoraConfig(r=4, lora_alpha=8, use_rslora=True, lora_dropout=0.0, target_modules="all-linear",
                                init_lora_weights=False)
            torch.manual_seed(1)
            stock = get_peft_model(stock, copy.deepcopy(config))
            torch.manual_seed(1)
            swapped = get_peft_model(swapped, copy.deepcopy(config))
            alone = (copy.deepcopy(stock), copy.deepcopy(swapped))
            return (fsdp2(stock, stock.base_model.model.model.layers),
                    fsdp2(swapped, swapped.base_model.model.model.layers), alone)
        alone = (copy.deepcopy(stock), copy.deepcopy(swapped))
        if mode == "moe-ddp":
            ddp = torch.nn.parallel.DistributedDataParallel
            return ddp(stock), ddp(swapped), alone
        return fsdp2(stock, stock.model.layers), fsdp2(swapped, swapped.model.layers), alone
    tied = mode.endswith("-tied")
    stock = tiny(tied)
    swapped = copy.deepcopy(stock)
    report = accel_patch.swap_kernels(swapped)
    assert "fused_linear_cross_entropy" in report.swapped, str(report)
    if mode.startswith("lora"):
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "v_proj"] + (["lm_head"] if mode == "lora-head" else [])
        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, init_lora_weights=False)
        torch.manual_seed(1)
        stock = get_peft_model(stock, copy.deepcopy(config))
        torch.manual_seed(1)
        swapped = get_peft_model(swapped, copy.deepcopy(config))
    # One process, every rank's data: stock (FSDP's own noise floor) and swapped (the swap's own).
    alone = (copy.deepcopy(stock), copy.deepcopy(swapped))
    if mode.startswith("fsdp1"):
        return fsdp1(stock), fsdp1(swapped), alone
    inner = (lambda m: m.base_model.model) if mode.startswith("lora") else (lambda m: m)
    return (fsdp2(stock, inner(stock).model.layers), fsdp2(swapped, inner(swapped).model.layers), alone)


def experts_of(model):
    """The first layer's experts module (under DDP's wrapper or PEFT's: its base layer)."""
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    inner = inner.base_model.model if hasattr(inner, "peft_config") else inner
    experts = inner.model.layers[0].mlp.experts
    return experts.get_base_layer() if hasattr(experts, "get_base_layer") else experts


def run_mode(mode: str, rank: int, out: str) -> dict:
    stock, swapped, alone = pair(mode)
    if mode == "checkpoint":
        return checkpoint(stock, swapped, rank, out)
    head = swapped.module if hasattr(swapped, "_fsdp_wrapped_module") else swapped
    sharded_head = type(getattr(getattr(head, "lm_head", None), "weight", None)).__name__
    before = gathered(stock)
    from accel_kernels import _launch

    stock_losses = train(stock, rank)
    with _launch.recording() as launched:
        swapped_losses = train(swapped, rank)
    alone_losses = train(alone[0], rank, one_process_batches(dist.get_world_size()))
    train(alone[1], rank, one_process_batches(dist.get_world_size()))
    a, b = gathered(stock), gathered(swapped)  # full weights on rank 0 only (cpu_offload)
    c, d = ({k: v.detach().float() for k, v in m.named_parameters()} for m in alone)
    result = {
        "stock_losses": stock_losses, "swapped_losses": swapped_losses, "one_process_losses": alone_losses,
        "loss_calls": loss_calls(swapped),
        "head_weight_type_outside_forward": sharded_head,
        "trainable": len(trainable_names(stock)),
    }
    if mode.startswith("moe"):
        live = accel_patch.report(swapped)
        result.update({
            "swapped": dict(live.swapped), "experts_calls": live.calls.get("experts"),
            "kernels_launched": sorted(set(launched)),
            "experts_weight_type_outside_forward": type(experts_of(swapped).gate_up_proj).__name__,
            "trainable_experts": [n for n in trainable_names(swapped) if ".experts." in n],
        })
        if mode == "moe-ddp":  # every rank holds the whole model: its own digest, and the ranks compared
            result["rank_digest"] = digest({k: v.detach().float() for k, v in swapped.module.named_parameters()})
            result["rank_sync"] = str(accel_patch.check_rank_sync(swapped))
    if rank == 0:
        result.update({
            "same_keys": sorted(a) == sorted(b),
            "max_weight_diff": max(float((a[k] - b[k]).abs().max()) for k in a),
            "noise_floor": max(float((a[k] - c[k]).abs().max()) for k in a if k in c),  # stock FSDP vs one process
            "swap_noise": max(float((c[k] - d[k]).abs().max()) for k in c),  # swapped vs stock, one process
            "moved": max(float((a[k] - before[k]).abs().max()) for k in a),
            "digest_swapped": digest(b), "digest_stock": digest(a),
            "lora_head_moved": max((float((b[k] - before[k]).abs().max()) for k in b if "lm_head.lora" in k),
                                   default=None),
        })
    return result


def checkpoint(stock, swapped, rank, out) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    root = os.path.join(out, "ckpt")
    for name, model in (("stock", stock), ("swapped", swapped)):
        dcp.save(get_model_state_dict(model), checkpoint_id=os.path.join(root, name, "sharded"))
        full = gathered(model)
        if rank == 0:
            model.save_pretrained(os.path.join(root, name, "pretrained"), state_dict=full)
        dist.barrier()
    return {"saved": True}


def zero3(path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("MASTER_PORT", "29561")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    config = {"train_batch_size": 2, "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True,
              "optimizer": {"type": "SGD", "params": {"lr": LR}}}
    stock = tiny(False)
    swapped = copy.deepcopy(stock)
    accel_patch.swap_kernels(swapped)
    result = {}
    for name, model in (("stock", stock), ("swapped", swapped)):
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
        w = engine.module.lm_head.weight
        result["partitioned"] = [hasattr(w, "ds_id"), str(w.ds_status).split(".")[-1], w.data.numel()]
        losses = []
        for batch in list(batches(0))[:2]:
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        result[f"{name}_losses"] = losses
    result["loss_calls"] = loss_calls(swapped)
    with open(path, "w") as f:
        json.dump(result, f)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES + MOE_MODES)}")
    p.add_argument("--zero3", metavar="FILE")
    args = p.parse_args()
    if args.zero3:
        return zero3(args.zero3)
    if not args.out:
        p.error("--out is required")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {"world_size": dist.get_world_size(), "triton_interpret": os.environ.get("TRITON_INTERPRET")}
    for mode in args.modes.split(","):
        try:
            results[mode] = run_mode(mode, rank, args.out)
        except Exception as exc:  # one broken mode must not hide the others' results
            import traceback

            results[mode] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        dist.barrier()
    with open(os.path.join(args.out, f"fsdp_rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
