"""`nanopt estimate CONFIG [--hardware KEY] [--gpus N] [--mfu F] [--tokens T]`: time, GPU-hours and cost to
train a config's stage plan at an assumed MFU, and the memory each GPU needs under each parallelism, before renting
anything. It counts a meta-device model (nanopt/recipe/mfu.py): ~2.5 s on 2 cores, most of it importing torch."""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict

from nanopt.config import Config, load_config, parse_overrides, split_args
from nanopt.distributed.hardware import PEAKS, matmul_precision, table_peak
from nanopt.distributed.memory import config_memory
from nanopt.errors import ConfigError
from nanopt.recipe.mfu import meta_model, param_counts, token_flops
from nanopt.training.plan import build_plan

_SCALE = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_tokens(text: str, params: int) -> int:
    """`24714985472`, `2.5e10`, `25B` / `300M` / `1.2T`, or `20x` (tokens per parameter)."""
    s, scale = text.strip().lower().replace("_", "").replace(",", ""), {**_SCALE, "x": params}
    try:
        value = float(s[:-1]) * scale[s[-1]] if s and s[-1] in scale else float(s)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"`--tokens {text}` is not a token count; write e.g. 25000000000, 2.5e10, 25B or "
                          f"20x (tokens per parameter).")
    return int(round(value))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nanopt estimate", allow_abbrev=False,
        usage="nanopt estimate [CONFIG | --config CONFIG] [options] [--section.key=value ...]",
        description="Time, GPU-hours and cost to train a config at an assumed MFU (6N + causal attention FLOPs, "
                    "dense peaks; also in the 6N and full-attention conventions), with --section.key=value overrides.")
    parser.add_argument("--hardware", default="h100-sxm", help=f"one of: {', '.join(PEAKS)} (default h100-sxm)")
    parser.add_argument("--gpus", type=int, default=None, help="number of devices (default: mfu.devices)")
    parser.add_argument("--mfu", type=float, default=0.4, help="assumed MFU, 0-1 (default 0.4)")
    parser.add_argument("--tokens", help="tokens to train at train.seq_len (25B, 2.5e10, 20x = per parameter); "
                                         "default: the config's stage plan, each stage at its own batch and seq_len")
    parser.add_argument("--price-per-gpu-hour", type=float, default=None, help="USD; without it cost is null")
    parser.add_argument("--shard-group-size", type=int, default=None, help="GPUs per hsdp shard group for the "
                        "memory table (default: 8, one node, when --gpus is a larger multiple of it)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def main(argv: list[str]) -> int:
    args, rest = _parser().parse_known_args(argv)
    path, rest = split_args(rest)  # the config path, positional or --config, as `nanopt train` reads it
    cfg = load_config(path, parse_overrides(rest))
    t, given = cfg.train, args.gpus is not None
    gpus = args.gpus if given else cfg.mfu.devices
    price = args.price_per_gpu_hour
    for bad, why in ((args.hardware not in PEAKS,
                      f"`--hardware {args.hardware}` is not in the peak table; valid: {', '.join(PEAKS)}."),
                     (gpus <= 0, f"`--gpus` must be positive, got {gpus}."),
                     (not 0 < args.mfu <= 1, f"`--mfu` is a fraction in (0, 1], e.g. 0.4 for 40%; got {args.mfu}."),
                     (price is not None and not 0 <= price < math.inf,  # NaN fails too
                      f"`--price-per-gpu-hour` must be zero or positive, got {price}.")):
        if bad:
            raise ConfigError(why)
    if table_peak(args.hardware, t.precision) is None:
        raise ConfigError(f"{PEAKS[args.hardware].name} has no published dense {matmul_precision(t.precision)} "
                          f"peak; estimate a bf16 run (--train.precision=bf16).")
    group = args.shard_group_size
    if group is None:  # one node of 8 when the GPUs are a larger multiple of 8, else no hsdp row
        group = 8 if gpus > 8 and gpus % 8 == 0 else None
    elif group < 1 or gpus % group:
        raise ConfigError(f"`--shard-group-size {group}` must be a positive divisor of the {gpus} GPUs: hsdp shards "
                          f"each tensor over a group of that many and replicates it across the groups.")
    plan, model = build_plan(t, gpus), meta_model(cfg.model)
    counts, mfu = param_counts(model), args.mfu
    stages, source = [(s.tokens, s.seq_len) for s in plan.stages], f"the config's plan: {t.max_steps:,} steps"
    if args.tokens is not None:
        stages = [(parse_tokens(args.tokens, counts.total), t.seq_len)]
        source = f"--tokens {args.tokens}, all at seq {t.seq_len}"
    # 6N + attention FLOPs, which grow with seq_len: each stage's tokens at its own (FLOPs per token: the mean)
    per_stage = [(n, token_flops(model, seq_len, cfg.mfu.causal_halving)) for n, seq_len in stages]
    tokens = sum(n for n, _ in per_stage)
    total_flops, full = sum(n * f.model for n, f in per_stage), sum(n * f.full_attention for n, f in per_stage)
    six_n, peak = 6 * counts.n_6n, table_peak(args.hardware, t.precision)
    hours = total_flops / (gpus * peak * mfu) / 3600
    r = {
        "params": counts.total, "n_6n": counts.n_6n,
        "flops_per_token": round(total_flops / tokens), "flops_per_token_6n": six_n,
        "flops_per_token_full_attention": round(full / tokens), "causal_halving": cfg.mfu.causal_halving,
        "seq_len": max(seq_len for n, seq_len in stages if n), "tokens": tokens,
        "tokens_per_param": tokens / counts.total,
        "total_flops": total_flops, "hardware": args.hardware, "precision": matmul_precision(t.precision),
        # The same speed as MFU in the other conventions (the blog's 6N, nanochat's and torchtitan's full square).
        "peak_flops_per_gpu": peak, "gpus": gpus, "mfu": mfu,
        "mfu_6n": mfu * six_n * tokens / total_flops, "mfu_full_attention": mfu * full / total_flops,
        "hours": hours, "gpu_hours": hours * gpus, "price_per_gpu_hour": price,
        "cost_usd": None if price is None else hours * gpus * price,
        "tokens_source": source, "gpus_source": "--gpus" if given else "mfu.devices",
        # The plan's stages but for accum: on --gpus ranks it may not divide (`nanopt train` refuses that).
        "stages": None if args.tokens else [{k: v for k, v in asdict(s).items() if k != "accum"} for s in plan.stages],
    }
    capacity = PEAKS[args.hardware].memory_bytes  # per GPU under each parallelism (nanopt/distributed/memory.py)
    rows = [{**m.summary(), "fits": m.total <= capacity} for m in config_memory(cfg, model, gpus, group)]
    recomputed = config_memory(cfg, model, gpus, group, recompute=True)[0].activations
    r["memory"] = {"capacity_bytes": capacity, "rows": rows, "activations_with_block_recompute": recomputed,
                   "config_parallel": cfg.runtime.parallel}
    print(json.dumps(r) if args.json else _text(cfg, r, stages, given))
    return 0


def _text(cfg: Config, r: dict, stages: list[tuple[int, int]], given: bool) -> str:
    """The estimate as the terminal shows it."""
    t, memory, hours = cfg.train, r["memory"], r["hours"]
    gb = lambda n: f"{n / 1e9:,.1f} GB"  # noqa: E731  decimal GB, as the spec sheets give memory
    at = f"at seq {r['seq_len']}" if len({seq for n, seq in stages if n}) == 1 else "averaged over the stages' seq_len"
    wall = (f"{hours:,.1f} h ({hours / 24:,.1f} days)" if hours >= 1 else
            f"{hours * 60:.1f} min" if hours * 60 >= 1 else f"{hours * 3600:.2f} s")
    devices = "--gpus" if given else "the config's mfu.devices; --gpus N for another count"
    cost = (f"${r['cost_usd']:,.2f} at ${r['price_per_gpu_hour']:.2f}/GPU-hour" if r["cost_usd"] is not None
            else "pass --price-per-gpu-hour for a cost")
    lines = [
        f"{cfg.run.name}: {r['gpus']} × {PEAKS[r['hardware']].name} "
        f"({r['peak_flops_per_gpu'] / 1e12:.1f} TFLOP/s dense {r['precision']} each) at {100 * r['mfu']:.0f}% MFU",
        f"  devices        {r['gpus']} ({devices})",
        f"  parameters     {r['params']:,} (N for 6N: {r['n_6n']:,})",
        f"  FLOPs/token    {r['flops_per_token']:.4g} (6N + {'causal' if r['causal_halving'] else 'full'} attention "
        f"{at}); 6N alone {r['flops_per_token_6n']:.4g}; full attention {r['flops_per_token_full_attention']:.4g}",
        f"  same speed     {100 * r['mfu']:.1f}% MFU here = {100 * r['mfu_6n']:.1f}% in 6N alone (the blog) = "
        f"{100 * r['mfu_full_attention']:.1f}% with full attention (nanochat, torchtitan)",
        f"  tokens         {r['tokens']:,} ({r['tokens_source']}; {r['tokens_per_param']:.1f} tokens/parameter)",
        *(f"  stage {s['number']:<8} from step {s['first_step']:,}: {s['steps']:,} steps × {s['batch_tokens']:,} "
          f"tokens at seq {s['seq_len']} = {s['tokens']:,} tokens" for s in r["stages"] or []),
        f"  total FLOPs    {r['total_flops']:.3g}",
        f"  wall time      {wall}",
        f"  GPU-hours      {r['gpu_hours']:,.{1 if r['gpu_hours'] >= 10 else 3}f}",
        f"  cost           {cost}",
        f"  memory per GPU (eager step at micro-batch {t.micro_batch_size} × seq {t.seq_len}, {t.precision}, "
        f"{cfg.optim.name}; {gb(memory['capacity_bytes'])} each; docs/mfu.md)",
        f"    {'parallel':<14}{'params':>10}{'grads':>10}{'optimizer':>11}{'activations':>13}{'total':>11}  fits"]
    for m in memory["rows"]:
        name = m["parallel"] if m["parallel"] == "ddp" else f"{m['parallel']} over {m['shard_ranks']}"
        fits = f"yes ({100 * m['total'] / memory['capacity_bytes']:.0f}%)" if m["fits"] else "NO"
        mark = "  <- runtime.parallel" if m["parallel"] == memory["config_parallel"] else ""
        lines.append(f"    {name:<14}" + "".join(f"{gb(m[k]):>{w}}" for k, w in (
            ("params", 10), ("grads", 10), ("optimizer", 11), ("activations", 13), ("total", 11))) + f"  {fits}{mark}")
    if not t.recompute:
        lines.append(f"    activations with per-block recompute (--train.recompute=true): "
                     f"{gb(memory['activations_with_block_recompute'])}")
    return "\n".join(lines)
