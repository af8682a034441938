"""ZenFlow's loss against plain optimizer offload on CPU (issue 14, session 50): what its speed would cost.

DeepSpeed 0.19.8's ZenFlow (ZeRO stage 2, `zero_optimization.zenflow`) updates the top-k gradient columns on the
device every micro-batch and the rest in a CPU Adam every `update_interval` micro-batches, in a separate process
that overlaps the next micro-batches when `overlap_step` is on. Its throughput is measured on a GPU by
`benchmarks/gpu_x1.sh zenflow`; this measures what it does to the loss, on a tiny Llama memorising 16 random
sequences (a task plain AdamW drives to ~0), with the same micro-batches, data order, lr and tokens per full update:

    python benchmarks/zenflow_convergence.py            # ~6 min on 2 cores: offload GA 4, four ZenFlow variants
    python benchmarks/zenflow_convergence.py --lr 1e-3  # the same at a smaller learning rate

Prints the mean loss of each 50 micro-batches, one column per variant. Each variant runs in its own process (one
process group each; ZenFlow's optimizer process is spawned and needs an importable main).
"""
import argparse
import os
import subprocess
import sys

# name: (mode, overlap, ZenFlow's select_interval in full updates: the top-k columns chosen again, their device-side
# Adam moments cleared)
VARIANTS = {"offload": ("off", False, 0), "ZF overlap, select 1": ("zf", True, 1), "ZF, select 1": ("zf", False, 1),
            "ZF overlap, select 50": ("zf", True, 50), "ZF, select 50": ("zf", False, 50)}


def train(mode: str, overlap: bool, select: int, lr: float, port: int, micro_steps: int, interval: int) -> list[float]:
    import deepspeed
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed("gloo")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=320))
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}}
    if mode == "zf":  # one full update per `interval` micro-batches, as GA `interval` does without it
        zero["zenflow"] = {"topk_ratio": 0.1, "update_interval": interval, "overlap_step": overlap,
                           "select_strategy": "step", "select_interval": select * interval}
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1 if mode == "zf" else interval,
              "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
              "zero_optimization": zero}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, 320, (16, 65), generator=gen)
    losses = []
    for _ in range(micro_steps):
        batch = data[torch.randint(0, 16, (4,), generator=gen)]
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--micro-steps", type=int, default=400)
    parser.add_argument("--interval", type=int, default=4, help="GA of the offload run = ZenFlow's update_interval")
    parser.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        mode, overlap, select, port = args.child[0], args.child[1] == "1", int(args.child[2]), int(args.child[3])
        print("LOSSES", *train(mode, overlap, select, args.lr, port, args.micro_steps, args.interval), flush=True)
        return
    curves = {}
    for n, (name, spec) in enumerate(VARIANTS.items()):
        child = [spec[0], "1" if spec[1] else "0", str(spec[2]), str(29650 + n)]
        out = subprocess.run([sys.executable, __file__, "--lr", str(args.lr), "--micro-steps", str(args.micro_steps),
                              "--interval", str(args.interval), "--child", *child],
                             capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        line = [x for x in out.stdout.splitlines() if x.startswith("LOSSES")]
        if out.returncode or not line:
            sys.exit(f"{name}: exit {out.returncode}\n{out.stderr[-3000:]}")
        curves[name] = [float(x) for x in line[0].split()[1:]]
    print(f"lr {args.lr}, micro-batch 4, {args.interval} micro-batches per full update (offload: GA {args.interval}); "
          "mean loss per 50 micro-batches")
    print("micro-batches | " + " | ".join(curves))
    for k in range(0, args.micro_steps, 50):
        print(f"{k}-{k + 49} | " + " | ".join(f"{sum(c[k:k + 50]) / len(c[k:k + 50]):.4f}" for c in curves.values()))


if __name__ == "__main__":
    main()
