"""Train LitGPT's `GPT` from a LitGPT config name (random initialisation, no download) on the main job's data, in
LitGPT's own Fabric setup order, under `Fabric(strategy="zoff")` or, to compare, Fabric's FSDP or DDP.

The loop is LitGPT's pretraining loop, shortened: the model built under `fabric.init_module(empty_init=True)`,
`model = fabric.setup(model)`, an AdamW over `model.parameters()` (`fused=True` on CUDA, as LitGPT passes it),
`fabric.setup_optimizers(optimizer)`, micro-batches under `fabric.no_backward_sync`, `fabric.clip_gradients`, and a
`fabric.save` of the state at the end. The data: the corpus of the main job (the Python standard library's bytes,
`lightning_zoff.examples.corpus`), whose byte tokens fit any LitGPT vocabulary.

    python scripts/train_litgpt.py --model pythia-14m --max-steps 20                 # 2 CPU ranks
    python scripts/train_litgpt.py --model Llama-3.2-1B --devices 1 --micro-batch 8 --block-size 2048 \\
        --strategy zoff --json out.json                                          # a GPU; --strategy fsdp to compare

Prints each logged step's loss and time, then a one-line summary (s/step: the median after `--warmup` steps); with
`--json`, writes the run's numbers. Needs `pip install --no-deps 'litgpt==0.5.13'` (its pins would move packages the
rest uses).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy, FSDPStrategy
from litgpt import GPT, Config
from litgpt.model import Block

import lightning_zoff  # noqa: F401  (registers strategy="zoff" with Fabric)
from lightning_zoff.examples.corpus import CorpusDataModule


def options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pythia-14m", help="a LitGPT config name (litgpt.Config.from_name)")
    parser.add_argument("--n-layer", type=int, default=None, help="override the config's number of layers")
    parser.add_argument("--strategy", default="zoff", choices=["zoff", "fsdp", "ddp"])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default=None, help="default: bf16-mixed on CUDA, 32-true on CPU")
    parser.add_argument("--block-size", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per rank and micro-batch")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the s/step median")
    parser.add_argument("--lr", type=float, default=4e-4)
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--max-bytes", type=int, default=4_000_000, help="corpus bytes to read")
    parser.add_argument("--out", type=Path, default=Path("out/litgpt"), help="where fabric.save writes")
    parser.add_argument("--json", type=Path, default=None, help="write the run's numbers here")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--tie-embeddings", action="store_true",
                        help="transformer.wte.weight = lm_head.weight, as LitGPT's pretrain.py does with"
                             " train.tie_embeddings")
    parser.add_argument("--full-init", action="store_true",
                        help="build the model with its values on every rank, as under DDP (by default zoff and FSDP"
                             " build it on the meta device and initialise each unit by its reset_parameters())")
    return parser.parse_args(argv)


def make_strategy(name: str):
    if name == "fsdp":  # as LitGPT's pretrain.py sets it up for several devices
        return FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="full", sharding_strategy="FULL_SHARD")
    if name == "ddp":
        return DDPStrategy(start_method="popen") if torch.cuda.is_available() else "ddp"
    return "zoff"


def train(fabric: Fabric, args: argparse.Namespace) -> dict:
    fabric.seed_everything(args.seed)  # the same on every rank: each builds the same model
    config = Config.from_name(args.model, block_size=args.block_size,
                              **({"n_layer": args.n_layer} if args.n_layer else {}))
    empty_init = args.strategy != "ddp" and not args.full_init
    with fabric.init_module(empty_init=empty_init):
        model = GPT(config)
    if args.tie_embeddings:
        model.transformer.wte.weight = model.lm_head.weight
    model.max_seq_length = args.block_size
    parameters = sum(p.numel() for p in model.parameters())
    model = fabric.setup(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95),
                                  fused=fabric.device.type == "cuda")
    optimizer = fabric.setup_optimizers(optimizer)
    data = CorpusDataModule(block_size=args.block_size, batch_size=args.micro_batch, max_bytes=args.max_bytes,
                            seed=args.seed)
    data.setup("fit")
    loader = fabric.setup_dataloaders(data.train_dataloader())

    losses, step_s = [], []
    batches = iter(loader)
    fabric.barrier()
    for step in range(1, args.max_steps + 1):
        start = time.perf_counter()
        for micro in range(args.accumulate):
            x, y = next(batches)
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
                fabric.backward(loss / args.accumulate)
        fabric.clip_gradients(model, optimizer, max_norm=args.max_norm)
        optimizer.step()
        optimizer.zero_grad()
        loss_value = loss.item()  # waits for the accelerator: the step's time is whole
        step_s.append(time.perf_counter() - start)
        losses.append(loss_value)
        if step % args.log_every == 0 or step == args.max_steps:
            fabric.print(f"step {step} loss {loss_value:.4f} {step_s[-1]:.3f} s")
    fabric.save(args.out / f"{args.strategy}.ckpt", {"model": model, "optimizer": optimizer, "step": args.max_steps})
    fabric.print(f"checkpoint: {args.out / f'{args.strategy}.ckpt'}")
    timed = step_s[args.warmup:] or step_s
    s_per_step = statistics.median(timed)
    tokens = args.micro_batch * args.block_size * args.accumulate * fabric.world_size
    result = {
        "model": args.model, "n_layer": config.n_layer, "parameters": parameters, "strategy": args.strategy,
        "tie_embeddings": args.tie_embeddings,
        "devices": fabric.world_size, "precision": str(fabric.strategy.precision.precision),
        "micro_batch": args.micro_batch, "block_size": args.block_size, "accumulate": args.accumulate,
        "steps": args.max_steps, "warmup": args.warmup, "s_per_step": s_per_step, "tokens_per_s": tokens / s_per_step,
        "step_s": step_s, "losses": losses,
    }
    if fabric.device.type == "cuda":
        result["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 1e9
    fabric.print(f"{args.strategy} {args.model} ({parameters / 1e9:.2f}B): {s_per_step:.3f} s/step,"
                 f" {result['tokens_per_s']:.0f} tokens/s, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return result


def main(argv: list[str] | None = None) -> None:
    args = options(argv)
    cuda = torch.cuda.is_available()
    precision = args.precision or ("bf16-mixed" if cuda else "32-true")
    fabric = Fabric(accelerator="cuda" if cuda else "cpu", devices=args.devices, strategy=make_strategy(args.strategy),
                    precision=precision)
    fabric.launch()
    result = train(fabric, args)
    if args.json is not None and fabric.is_global_zero:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
