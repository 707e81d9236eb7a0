"""The `plan`, `simulate` and `calibrate` verbs. Imports stay inside the verbs so `paralm --help` is fast."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from paralm.errors import UserError

RECIPES = ("paper", "fp32-grads", "fp32-master")  # the keys of memory.STATE_RECIPES


def add_plan_verbs(verbs: argparse._SubParsersAction) -> None:
    plan = verbs.add_parser(
        "plan",
        help="predict memory and step time of parallel layouts and recommend the fastest that fits",
        description="Layout fields given on the command line are fixed, the rest are searched "
        "(fields from --config are not fixed).",
    )
    _common(plan)
    plan.add_argument("--cluster", help="preset[:COUNT] (h100:64, a100-80gb:1024, h200x8) or a TOML file")
    plan.add_argument(
        "--validate",
        action="store_true",
        help="price the published GPU runs paralm ships (docs/planner-validation.md) and compare, in-sample and "
        "held out by source; --cluster prices the runs of its chip on it (default: the h100 and a100-80gb presets)",
    )
    plan.add_argument(
        "--choices",
        action="store_true",
        help="with --validate: for each published run, the layout paralm recommends for its model, cluster and batch "
        "against the published one, and what paralm refuses of that (searches every run: a minute or more)",
    )
    plan.add_argument("--top", type=int, default=10, help="layouts to show (and to write with --json); 0: all")
    plan.add_argument(
        "--measure",
        action="store_true",
        help="time each shown layout's per-rank forward and backward on this machine's GPU (else its CPU) and "
        "price the step with it (one build per distinct rank shape: --top bounds the time)",
    )
    plan.add_argument("--write-config", metavar="PATH", help="write the best layout as a config paralm trains with")
    plan.set_defaults(func=_plan)

    simulate = verbs.add_parser("simulate", help="the best layout's throughput, MFU and memory over cluster sizes")
    _common(simulate)
    simulate.add_argument("--cluster", required=True, help="preset or TOML file (its device count is ignored)")
    simulate.add_argument("--devices", required=True, help="comma-separated cluster sizes, e.g. 8,64,512")
    simulate.add_argument(
        "--scaling",
        choices=("strong", "weak", "both"),
        default="both",
        help="strong: the global batch stays; weak: it grows with the devices from the first size",
    )
    simulate.add_argument("--plot", metavar="PNG", help="plot tokens/s and MFU against devices (needs matplotlib)")
    simulate.set_defaults(func=_simulate)

    calibrate = verbs.add_parser(
        "calibrate", help="measure this machine (matmul peak, memory, all-reduce) into a cluster file"
    )
    calibrate.add_argument("--out", required=True, help="TOML file to write")
    calibrate.add_argument("--devices", type=int, default=2, help="local workers that share this machine")
    calibrate.add_argument(
        "--ps-servers",
        type=int,
        default=0,
        help="of the devices, how many will serve parameters (sync.ps_servers) and compute nothing",
    )
    calibrate.set_defaults(func=_calibrate)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML config for the model and batch (default: the built-in tiny model)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--recipe",
        choices=RECIPES,
        default="fp32-master",
        help="model-state bytes under bf16/fp16: fp32-master (default: autocast/FSDP2, as paralm stores "
        "them), paper (ZeRO: 16-bit params and grads + fp32 master), fp32-grads (Megatron); fp32 is the same for all",
    )
    parser.add_argument("--no-overlap", action="store_true", help="assume no communication hides behind compute")


def _plan(args: argparse.Namespace, overrides: list[str]) -> int:
    from paralm.plan.cluster import parse_cluster
    from paralm.plan.head import assumed_line
    from paralm.plan.heldout import banded
    from paralm.plan.moe import moe_summary
    from paralm.plan.muon import muon_summary
    from paralm.plan.report import band_line, plans_table, summary
    from paralm.plan.request import load_request
    from paralm.plan.search import search
    from paralm.plan.validation_report import error_line, report

    if args.choices and not args.validate:
        raise UserError("--choices goes with --validate (paralm plan --validate --choices)")
    if args.validate:
        if args.choices:
            from paralm.plan.choices import choices_table

            print(choices_table(args.cluster or "h100"))
            return 0
        print(report(args.cluster or "h100"))
        return 0
    if not args.cluster:
        raise UserError("paralm plan needs --cluster (a preset such as h100:64, or a TOML file), or --validate")
    if args.top < 0:
        raise UserError(f"--top {args.top} must not be negative")
    config, fixed = load_request(args.config, overrides)
    cluster = parse_cluster(args.cluster)
    work, plans = search(
        config,
        cluster,
        fixed,
        recipe=args.recipe,
        overlap=not args.no_overlap,
    )
    shown = [banded(plan, work, cluster) for plan in (plans[: args.top] if args.top else plans)]
    if args.measure:
        from paralm.plan.measure import Measurer, device_line

        measurer = Measurer(config)
        shown = [measurer.price(plan, work) for plan in shown]
    if args.write_config:
        path = Path(args.write_config)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(plans[0].layout.apply_to(config).to_toml())
    if args.json:
        json.dump([p.row() for p in shown], sys.stdout, indent=1)
        print()
        return 0
    print(summary(work, cluster, args.recipe, not args.no_overlap))
    print(assumed_line(work, cluster, plans[0].layout.tp))
    print(error_line())
    if experts := moe_summary(plans[0].layout, work, plans[0].time.ep_comm_s):
        print(experts)
    if muon := muon_summary(work, cluster):
        print(muon)
    print(f"{len(plans)} layouts fit (of each, the largest micro-batch that fits); the fastest {len(shown)}:")
    print(plans_table(shown))
    print(band_line(shown[0]))
    if args.measure:
        print(f"{device_line(measurer.device)}; {len(measurer.cache)} distinct rank shapes built")
    if args.write_config:
        print(f"wrote the best layout to {args.write_config}")
    return 0


def _simulate(args: argparse.Namespace, overrides: list[str]) -> int:
    from paralm.plan.cluster import parse_cluster
    from paralm.plan.request import load_request
    from paralm.plan.simulate import plot, scaling_table, simulate

    try:
        sizes = sorted({int(n) for n in args.devices.split(",") if n.strip()})
    except ValueError:
        raise UserError(f"--devices {args.devices!r}: expected comma-separated integers, e.g. 8,64,512") from None
    if not sizes or sizes[0] < 1:
        raise UserError("--devices needs at least one positive cluster size")
    config, fixed = load_request(args.config, overrides)
    cluster = parse_cluster(args.cluster)
    modes = ("strong", "weak") if args.scaling == "both" else (args.scaling,)
    results = {
        mode: simulate(
            config,
            cluster,
            sizes,
            fixed,
            mode,
            recipe=args.recipe,
            overlap=not args.no_overlap,
        )
        for mode in modes
    }
    if args.plot:
        plot(
            results, args.plot, title=f"{cluster.name}, {config.model.n_layer} layers x d_model {config.model.d_model}"
        )
    if args.json:
        json.dump({mode: [point.row() for point in points] for mode, points in results.items()}, sys.stdout, indent=1)
        print()
        return 0
    for mode, points in results.items():
        print(f"{mode} scaling:")
        print(scaling_table(points))
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


def _calibrate(args: argparse.Namespace, overrides: list[str]) -> int:
    from paralm.plan.calibrate import calibrate

    if overrides:
        raise UserError(f"`paralm calibrate` measures the machine, not a model: drop {' '.join(overrides)}")
    if args.devices < 1:
        raise UserError(f"--devices {args.devices}: at least one")
    if not 0 <= args.ps_servers < args.devices:
        raise UserError(f"--ps-servers {args.ps_servers}: 0 to {args.devices - 1} (--devices - 1), leaving a worker")
    cluster = calibrate(args.devices, log=lambda line: print(line, file=sys.stderr), ps_servers=args.ps_servers)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(cluster.to_toml())
    print(f"wrote {path}")
    return 0
