"""The `paralm rl` verb: a reinforcement-learning run from a trained model (`checkpoint.init_from`), on one process,
`--nproc N` local workers or under torchrun, with the training loop's run folder, checkpoints and metrics."""

from __future__ import annotations

import argparse
import os


def add_rl_verb(verbs: argparse._SubParsersAction) -> None:
    rl = verbs.add_parser(
        "rl",
        help="reinforcement learning from verifiable rewards (GRPO, DAPO, Dr. GRPO) on a trained model",
        epilog="Config fields are overridden as --section.field=value, e.g. --rl.group_size=8 (docs/rl.md).",
    )
    rl.add_argument("--config", help="TOML config file with an [rl] section (default: the built-in tiny model)")
    rl.add_argument("--nproc", type=int, default=1, help="local worker processes to start")
    rl.set_defaults(func=run_rl)


def run_rl(args: argparse.Namespace, overrides: list[str]) -> int:
    from paralm.launch.lifeline import die_with_parent, running_under_launcher, started_by_launcher

    if started_by_launcher():
        die_with_parent()
    from paralm.config.dims import ParallelDims
    from paralm.config.load import load_config
    from paralm.config.rl_rules import check_rl
    from paralm.job import train
    from paralm.launch.local import launch_local_workers
    from paralm.rl.engine import RolloutEngine

    config = load_config(args.config, overrides, init_model=True)
    check_rl(config)
    config.train.steps = config.rl.steps * config.rl.updates_per_rollout  # the loop counts optimizer steps
    world_size = int(os.environ.get("WORLD_SIZE", args.nproc))
    ParallelDims.from_config(config.parallel, config.sync, world_size)  # fail before spawning
    if args.nproc > 1 and not running_under_launcher():
        argv = ["rl", *(["--config", args.config] if args.config else []), *overrides]
        return launch_local_workers(args.nproc, argv, 0, config.run.dir)
    train(config, RolloutEngine)
    return 0
