"""CLI verbs of the runtime stage: `plan` (placement plans; the engine's verbs come with issue 5)."""

import argparse

DTYPE_CHOICES = ("float32", "float16", "bfloat16", "int8")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="choose the hot (resident) MLP neurons for a fast-memory budget from the activation profile",
        description="From CKPT/profile.safetensors and a fast-memory budget, reserve what every token touches (attention, "
        "embeddings + lm_head, norms, MoE routers, predictors, KV cache for --context) and fill the rest with the most "
        "frequently firing neuron bundles (gate row + up row + down column), per layer (per expert for MoE), which "
        "maximises the expected resident hits. Writes CKPT/plan.json (or --out); optionally PowerInfer's GPU index.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("ckpt", help="a sparse checkpoint with a profile (sparseforge profile); the plan is written into it")
    p.add_argument("--fast-memory", required=True, metavar="SIZE",
                   help="total fast memory: bytes, 300MB, 1.5GiB (decimal and binary units); or N%% = N%% of the MLP "
                   "neuron bytes resident on top of the always-touched part")  # fmt: skip
    p.add_argument("--context", type=int, default=2048, help="tokens of KV cache to reserve")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=None,
                   help="weight dtype in fast memory (int8: weight-only, float32 row scales, float32 KV cache); default: as stored")  # fmt: skip
    p.add_argument("--out", default="plan.json", help="file name of the plan inside the checkpoint, e.g. plan-25pct.json")
    p.add_argument("--powerinfer-gpu-index", metavar="DIR", default=None,
                   help="also write PowerInfer's GPU index (DIR/model.powerinfer.gguf.generated.gpuidx); dense models only")  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="print only the output paths")
    p.set_defaults(func=plan_command)


def plan_command(args) -> int:
    from sparseforge.runtime.plan import PlanRequest, artifact_name, format_plan, make_plan, parse_size, write_plan, write_powerinfer_gpu_index

    request = PlanRequest(parse_size(args.fast_memory), context=args.context, dtype=args.dtype)
    artifact_name(args.out)  # a bad --out fails before any work
    plan = make_plan(args.ckpt, request)
    if not args.quiet:
        print(format_plan(plan))
    print(f"wrote {write_plan(args.ckpt, plan, args.out)}")
    if args.powerinfer_gpu_index:
        print(f"wrote {write_powerinfer_gpu_index(plan, args.powerinfer_gpu_index)}")
    return 0
