"""CLI verbs of the runtime stage: `plan` (placement plans), `generate`, `chat` and `serve` (the decode engine)."""

import argparse
import sys
from typing import TYPE_CHECKING

from sparseforge.cli_options import HelpFormatter, check_positive
from sparseforge.errors import SparseforgeError
from sparseforge.runtime.sizes import DTYPES, KV_DTYPE_CHOICES, PLAN_MODES

if TYPE_CHECKING:
    from sparseforge.runtime.sampling import GenerationConfig



def register(subparsers) -> None:
    register_plan(subparsers)
    register_engine_verbs(subparsers)


def register_plan(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="choose the hot (resident) MLP neurons for a fast-memory budget from the activation profile",
        description="From CKPT/profile.safetensors and a fast-memory budget, reserve what every token touches (attention, "
        "embeddings + lm_head, norms, MoE routers, the predictors or the MLP screens (--mode), the lm_head's int8 screen, KV cache for --context) and fill the rest with the most "
        "frequently firing neuron bundles (gate row + up row + down column), per layer (per expert for MoE), which "
        "maximises the expected resident hits. Writes CKPT/plan.json (or --out); optionally PowerInfer's GPU index.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("ckpt", help="a sparse checkpoint with a profile (sparseforge profile); the plan is written into it")
    p.add_argument("--fast-memory", required=True, metavar="SIZE",
                   help="total fast memory: bytes, 300MB, 1.5GiB (decimal and binary units); or N%% = N%% of the MLP "
                   "neuron bytes resident on top of the always-touched part, 0%% to 100%% (0%%: no hot neurons; generate, "
                   "chat and serve need more than 0%% for their neuron cache)")  # fmt: skip
    p.add_argument("--context", type=int, default=2048, help="tokens of KV cache to reserve")
    p.add_argument("--kv-dtype", choices=KV_DTYPE_CHOICES, default="float32", help="KV cache dtype the engine will run (generate --kv-dtype)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="weight dtype in fast memory (int8: int8 weights with float32 row scales); default: as stored")  # fmt: skip
    p.add_argument("--predictor-dtype", choices=DTYPES, default=None,
                   help="dtype of the predictors the engine will run (generate --predictor-dtype); default: --dtype, as the engine's default")  # fmt: skip
    p.add_argument("--mode", choices=PLAN_MODES, default="auto",
                   help="the engine mode the plan is for: sparse reserves the predictors; screen reserves the MLP screens instead (int8 "
                   "copies of the gate rows, which list exactly the neurons that can fire); auto: screen where it applies (a "
                   "ReLU-family MLP, a float --dtype, no --predictor-dtype), else sparse, as generate --fast-memory's auto mode")  # fmt: skip
    p.add_argument("--full-head", action="store_true",
                   help="reserve no memory for the lm_head's int8 screen (for engines run with --full-head); the screen takes one "
                   "byte per head weight and is reserved by default for float dtypes")  # fmt: skip
    p.add_argument("--out", default="plan.json", help="file name of the plan inside the checkpoint, e.g. plan-25pct.json")
    p.add_argument("--powerinfer-gpu-index", metavar="DIR", default=None,
                   help="also write PowerInfer's GPU index (DIR/model.powerinfer.gguf.generated.gpuidx); dense models only")  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="print only the output paths")
    p.set_defaults(func=plan_command)


def plan_command(args) -> int:
    from sparseforge.runtime.plan import PlanRequest, artifact_name, format_plan, make_plan, write_plan, write_powerinfer_gpu_index
    from sparseforge.runtime.sizes import parse_size

    request = PlanRequest(parse_size(args.fast_memory), context=args.context, dtype=args.dtype, predictor_dtype=args.predictor_dtype,
                          head_screen=not args.full_head, kv_dtype=args.kv_dtype, mode=args.mode)  # fmt: skip
    artifact_name(args.out)  # a bad --out fails before any work
    plan = make_plan(args.ckpt, request)
    if not args.quiet:
        print(format_plan(plan))
    print(f"wrote {write_plan(args.ckpt, plan, args.out)}")
    if args.powerinfer_gpu_index:
        print(f"wrote {write_powerinfer_gpu_index(plan, args.powerinfer_gpu_index)}")
    return 0


# ---------------------------------------------------------------- generate / chat / serve


def _engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt", help="a sparse checkpoint (sparse mode needs its predictors: sparseforge predictors train)")
    p.add_argument("--mode", choices=("auto", "sparse", "dense", "oracle", "screen"), default="auto",
                   help="auto: screen where it applies (a ReLU-family MLP, float weights; not with --device or --predictor-dtype), "
                   "oracle for int8 weights of tied neuron halves (not with --fast-memory), else sparse; "
                   "sparse: compute the neurons the predictors select; dense: every neuron (the baseline); oracle: the exact "
                   "firing mask (computes the gate/up rows to find it, a pair at a time for tied halves); screen: the exact mask without a "
                   "predictor, an int8 copy of the gate/up rows proving most silent neurons zero (float weights; runtime/screen.py)")  # fmt: skip
    p.add_argument("--weight-dtype", choices=DTYPES, default="float32", help="weight dtype the engine computes with (int8: int8 weights, inputs of their dot products quantized per block of 32)")
    p.add_argument("--predictor-dtype", choices=DTYPES, default=None,
                   help="dtype of the sparse mode's predictors (default: --weight-dtype). int8 reads a quarter of float32's "
                   "predictor bytes per token and chooses the same neurons within rounding (docs/runtime.md)")  # fmt: skip
    p.add_argument("--context", type=int, default=2048, help="tokens of KV cache: prompt + generated tokens must fit")
    p.add_argument("--kv-dtype", choices=KV_DTYPE_CHOICES, default="float32",
                   help="KV cache dtype: float16 halves its memory and the bytes attention reads per token (keys and values rounded "
                   "once as they are written, attention computed in float32; docs/runtime.md \"KV cache\")")  # fmt: skip
    p.add_argument("--fast-memory", metavar="SIZE", default=None,
                   help="keep only this much resident (as for `sparseforge plan`: 300MB, 1.5GiB, 25%%; a percentage above 0%%, "
                   "since the neuron cache needs room); hot neurons pinned, cold neurons read from disk through the neuron cache. "
                   "Default: everything resident")  # fmt: skip
    p.add_argument("--device", default=None, metavar="DEV",
                   help="hybrid tier: attention, norms, embeddings, lm_head, KV cache and the hottest MLP neurons on this device "
                   "(cuda, cuda:1, mps; cpu runs the same split on the CPU), the other neurons computed by the CPU (with --fast-memory: "
                   "those held in that much CPU memory, the rest read from disk); default: CPU engine")  # fmt: skip
    p.add_argument("--device-memory", metavar="SIZE", default=None,
                   help="the device's budget for --device, as --fast-memory takes it (6GB, 1.5GiB, 25%% of the MLP bytes on top of "
                   "the always-touched part); default 100%%: everything on the device")  # fmt: skip
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--full-head", action="store_true",
                   help="decode steps (greedy and sampled) read the whole lm_head instead of finding the token through its int8 "
                   "screen (the same token; saves the screen's memory, one byte per head weight: docs/runtime.md \"Head screen\")")  # fmt: skip
    p.add_argument("--no-progress", action="store_true", help="no progress bar while loading")


def _sampling_options(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help="most tokens generated per reply")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; otherwise sample from softmax(logits / T)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens only (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of tokens whose probability reaches p")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling (same seed, same tokens)")


def register_engine_verbs(subparsers) -> None:
    fmt = HelpFormatter
    p = subparsers.add_parser("generate", help="generate text from a prompt with the sparse decode engine, streamed to stdout",
                              description="Tokenize --prompt (through the tokenizer's chat template when it has one, unless --raw), "
                              "prefill it densely, decode with the engine and stream the text to stdout (when there is none, a line on stderr "
                              "says why); --stats adds a line of speed and traffic figures on stderr.", formatter_class=fmt)  # fmt: skip
    _engine_options(p)
    p.add_argument("--prompt", required=True, help="the prompt text")
    _sampling_options(p, 128)
    template = p.add_mutually_exclusive_group()
    template.add_argument("--chat-template", dest="template", action="store_const", const="chat",
                          help="wrap the prompt as a user turn in the tokenizer's chat template (default when the tokenizer has one)")  # fmt: skip
    template.add_argument("--raw", dest="template", action="store_const", const="raw", help="tokenize the prompt as is")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="end the text before this string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens (always generate --max-new-tokens)")
    p.add_argument("--stats", action="store_true", help="print the engine's prefill/decode speed, neurons and bytes per token to stderr")
    p.set_defaults(func=generate_command, template=None)

    p = subparsers.add_parser("chat", help="interactive chat in the terminal (the tokenizer's chat template; /reset, Ctrl-D)",
                              description="Read one user message per line from stdin and stream the reply; the history is kept "
                              "(the oldest turns are dropped when it outgrows --context). /reset clears it; /exit or end of input ends.",
                              formatter_class=fmt)  # fmt: skip
    _engine_options(p)
    _sampling_options(p, 256)
    p.add_argument("--system", default=None, help="a system message for every conversation (default: the chat template's own)")
    p.set_defaults(func=chat_command)

    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, streaming)",
                              description="Serve the engine over HTTP (FastAPI + uvicorn): POST /v1/completions and "
                              "/v1/chat/completions (stream=true gives server-sent events), GET /v1/models and /health. Requests "
                              "run one at a time on the one engine, at most --max-queue waiting (then 503); a client that "
                              "disconnects cancels its request. Errors are OpenAI-style JSON. Ctrl-C stops it.", formatter_class=fmt)  # fmt: skip
    _engine_options(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; one reachable from other machines (0.0.0.0, a LAN address) needs --api-key or --allow-no-api-key")  # fmt: skip
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port, printed at start)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every /v1 route (/health stays open); default: $SPARSEFORGE_API_KEY, "
                   "which keeps the key out of the process list")  # fmt: skip
    p.add_argument("--allow-no-api-key", action="store_true", help="serve a --host reachable from other machines without an API key")
    p.add_argument("--model-name", default=None, help="the model id reported and echoed (default: the checkpoint folder's name)")
    p.add_argument("--default-max-tokens", type=int, default=None,
                   help="max_tokens for requests that do not set it (default: 256, or --max-tokens-limit when lower)")
    p.add_argument("--max-tokens-limit", type=int, default=2048, help="most tokens one request may ask for (a larger max_tokens gets a 400)")
    p.add_argument("--max-queue", type=int, default=16,
                   help="most requests waiting behind the running one; more get a 503 (retry later) at once")  # fmt: skip
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body accepted (a larger one gets a 413)")
    p.add_argument("--verbose", action="store_true", help="log every request to stderr")
    p.set_defaults(func=serve_command)


def _generation_config(args) -> "GenerationConfig":
    """The sampling flags, checked before the model loads; stop ids: the engine's EOS ids unless --ignore-eos."""
    from sparseforge.runtime.sampling import GenerationConfig

    check_positive(max_new_tokens=args.max_new_tokens)
    if args.temperature < 0:
        raise SparseforgeError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise SparseforgeError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise SparseforgeError(f"--top-k must be >= 0 (0 = no limit), got {args.top_k}")
    return GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            seed=args.seed, stop_ids=() if getattr(args, "ignore_eos", False) else None)  # fmt: skip


def _check_engine_options(args) -> None:
    """What the engine flags need from each other and from the checkpoint, said in flags, before the model loads."""
    from pathlib import Path

    from sparseforge.predictors.store import require_predictors
    from sparseforge.runtime.sizes import parse_size

    check_positive(context=args.context, threads=args.threads)
    if args.mode == "sparse" and (Path(args.ckpt) / "config.json").is_file():
        require_predictors(args.ckpt, "run without predictors: --mode screen, oracle or dense")
    if args.mode == "screen" and args.weight_dtype == "int8":
        raise SparseforgeError("--mode screen needs float weights (--weight-dtype float32, bfloat16 or float16); with --weight-dtype int8 "
                               "use --mode oracle, which reads the int8 gate rows once")  # fmt: skip
    if args.device_memory is not None and args.device is None:
        raise SparseforgeError(f"--device-memory {args.device_memory} needs --device (e.g. --device cuda); without it the engine runs on the CPU")
    if args.fast_memory is not None and parse_size(args.fast_memory).percent == 0:
        raise SparseforgeError(f"--fast-memory {args.fast_memory} leaves no room for the neuron cache that cold neurons are read into; "
                               "give a percentage above 0% (the smaller, the more neurons are read from disk) or a size")  # fmt: skip


def _open_engine(args):
    """runtime.engine.open_engine with the engine flags."""
    from sparseforge.runtime.engine import open_engine

    _check_engine_options(args)
    return open_engine(args.ckpt, mode=args.mode, weight_dtype=args.weight_dtype, context=args.context, threads=args.threads,
                       fast_memory=args.fast_memory, predictor_dtype=args.predictor_dtype, head_screen=False if args.full_head else None,
                       progress=not args.no_progress, device=args.device, device_memory=args.device_memory, kv_dtype=args.kv_dtype)  # fmt: skip


def format_stats(stats: dict) -> str:
    """The engine's stats dict as one line: numbers rounded, nested dicts flattened (store.hits=...)."""

    def flat(d: dict, prefix: str = ""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}={v:.4g}" if isinstance(v, float) else f"{prefix}{k}={v}"

    return "stats: " + " ".join(flat(stats))


def generate_command(args) -> int:
    from sparseforge.runtime.chat import Completion, encode_prompt, stream_text, why_no_text

    config = _generation_config(args)
    with _open_engine(args) as engine:
        ids = encode_prompt(engine.tokenizer, args.prompt, args.template)
        if len(ids) + args.max_new_tokens > engine.context:
            raise SparseforgeError(f"the prompt ({len(ids)} tokens) + --max-new-tokens {args.max_new_tokens} exceed --context "
                                   f"{engine.context}; raise --context or lower --max-new-tokens")  # fmt: skip
        done = Completion()
        for piece in stream_text(engine, ids, config, args.stop, done=done):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        if not done.text.strip():  # stdout stays the text alone; say on stderr why it is empty
            print(f"sparseforge generate: nothing to print: {why_no_text(done, engine.tokenizer)}", file=sys.stderr)
        if args.stats:
            print(format_stats(engine.stats()), file=sys.stderr)
    return 0


def chat_command(args) -> int:
    from sparseforge.runtime.chat import chat_loop

    config = _generation_config(args)
    with _open_engine(args) as engine:
        return chat_loop(engine, config, system=args.system)


def serve_command(args) -> int:
    import os
    from pathlib import Path

    from sparseforge.runtime.server import Server, ServerSettings

    settings = ServerSettings(
        host=args.host,
        port=args.port,
        model_id=args.model_name or Path(args.ckpt).resolve().name,
        api_key=args.api_key or os.environ.get("SPARSEFORGE_API_KEY") or None,
        allow_no_api_key=args.allow_no_api_key,
        default_max_tokens=min(256, args.max_tokens_limit) if args.default_max_tokens is None else args.default_max_tokens,
        max_tokens_limit=args.max_tokens_limit,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        verbose=args.verbose,
    )
    settings.check()  # a bad option fails before the model loads
    with _open_engine(args) as engine:
        server = Server(engine, settings)
        key = "API key required" if settings.api_key else "no API key"
        where = f", {args.device} {args.device_memory or '100%'}" if args.device else ""
        print(f"serving {settings.model_id} ({engine.model.mode}, {args.weight_dtype}{where}) on {server.url} ({key}; Ctrl-C stops)", file=sys.stderr, flush=True)
        server.serve_forever()
    return 0
