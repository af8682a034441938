"""`python -m raytrain.main [--config FILE] [--dry-run] [KEY=VALUE ...]`: parse, resolve, train."""

from __future__ import annotations

import argparse
import json
import signal
import sys

from raytrain.config import ConfigError, load_config
from raytrain.console import ArgumentParser, add_config_flag, flag_number, one_config, say


_EPILOG = """\
where a run's files go: STORAGE/RUN = checkpoint.storage_path/checkpoint.name (default ~/raytrain_runs/raytrain-DATE-TIME)

tracking (rank 0's metrics every training.log_every_n_steps: train/*, perf/*, system/*, checkpoint/*, eval/*):
  tracking.tensorboard=true          TensorBoard event files in STORAGE/RUN/tensorboard; for a cloud storage
                                     path (s3://, gs://, ...) in ~/raytrain_tensorboard/RUN on rank 0's node,
                                     where a new run of that name moves the earlier run's aside
  tracking.mlflow_tracking_uri=URI   also MLflow (pip install "raytrain[mlflow]"): a server http://HOST:5000,
                                     sqlite:///PATH/mlflow.db, or file:///PATH (with MLFLOW_ALLOW_FILE_STORE=true);
                                     one MLflow run per run, continued with it (STORAGE/RUN/tracking.json),
                                     a new one after --fresh; checked before anything starts, --dry-run too
  tracking.mlflow_experiment=NAME    the MLflow experiment (default raytrain; created when missing)

Every key, its type, range and default: raytrain/config.py; README.md explains them."""


def parse_args(argv: list[str] | None = None):
    parser = ArgumentParser(
        prog="python -m raytrain.main",
        description="Train a causal LM with DeepSpeed ZeRO-3 on a Ray cluster. "
                    "Precedence: KEY=VALUE > --config FILE > defaults.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flag(parser, "YAML run config (sections: model, data, training, scaling, checkpoint, cluster, "
                            "network, tracking, deepspeed)")
    parser.add_argument("--dry-run", action="store_true",
                        help="every check that needs no Ray (config, DeepSpeed JSON, paths, addresses, the data's "
                             "first records, memory) for the requested cluster shape; print the run as JSON, exit")
    dry = parser.add_argument_group("memory target of --dry-run (default: this machine), as for raytrain.tools.plan")
    dry.add_argument("--gpu-memory-gib", type=flag_number(float, above=0), help="memory of one GPU of the target")
    dry.add_argument("--host-memory-gib", type=flag_number(float, above=0), help="host RAM of one node of the target")
    dry.add_argument("--gpus-per-node", type=flag_number(int, minimum=1), help="GPUs (workers) per node of the target")
    parser.add_argument("--resume-from", metavar="PATH",
                        help="start from this checkpoint directory, the path as written (checkpoint.resume_from=PATH "
                             "reads its value as YAML)")
    parser.add_argument("--fresh", action="store_true",
                        help="the run name exists: set the old run aside (renamed, not deleted) and start over")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted overrides, e.g. training.max_steps=20 deepspeed=ds_config.json")
    # intermixed: KEY=VALUE overrides may come before and after the flags (`--resume-from X a.b=1`)
    args = parser.parse_intermixed_args(argv)
    args.config = one_config(parser, args.config)
    sizes = [f for f in ("gpu_memory_gib", "host_memory_gib", "gpus_per_node") if getattr(args, f) is not None]
    if sizes and not args.dry_run:
        parser.error(f"--{sizes[0].replace('_', '-')} states the target of --dry-run; a real run measures its "
                     f"cluster: add --dry-run or drop it")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)
    except SystemExit as e:  # --help, or a mistake in a flag (already reported in one line)
        return int(e.code or 0)
    # A path, taken as written: as a KEY=VALUE override it would be read as YAML ("yes" a boolean,
    # "null" nothing), and "" is refused like checkpoint.resume_from="" rather than dropped.
    resume = {"checkpoint.resume_from": args.resume_from} if args.resume_from is not None else {}
    try:
        cfg = load_config(args.config, args.overrides, values=resume, command_line=True)
        # The driver's modules only now: they import Ray, torch and transformers (~6.5 CPU-seconds on a
        # 2-core VM), which a mistyped flag or key needs none of: its one line comes in ~0.4 s.
        from raytrain.driver.run import dry_run, fit
        from raytrain.driver.watch import ExportInterrupted, Interrupted, RunFailed, Terminated
    except ConfigError as e:
        return _refused(e)
    except KeyboardInterrupt:
        return _interrupted_early()
    try:
        if args.dry_run:
            resolved, notes = dry_run(cfg, gpu_memory_gib=args.gpu_memory_gib, host_memory_gib=args.host_memory_gib,
                                      gpus_per_node=args.gpus_per_node, fresh=args.fresh)
            for note in notes:
                say(f"raytrain: {note}", err=True)  # stdout stays the JSON plan
            say(json.dumps(resolved.to_dict(), indent=2))
            return 0
        result = fit(cfg, fresh=args.fresh, argv=argv)
    except ConfigError as e:  # bad input, also a bad record found in the data while training
        return _refused(e)
    except (Interrupted, ExportInterrupted) as e:  # Ctrl-C or SIGTERM: the run is stopped (workers, controller gone)
        say(f"raytrain: {e}", err=True)
        return e.exit_code
    except RunFailed as e:  # Ray Train gave up (past checkpoint.max_failures): its checkpoints are kept
        say(f"raytrain: {e}", err=True)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C (or SIGTERM, once the run is placed) before training started
        return _interrupted_early(isinstance(e, Terminated))
    loss = result.metrics.get("loss")
    say(f"raytrain: done at step {result.metrics.get('step')}, loss {loss:.4f}" if loss is not None else "raytrain: done")
    say(f"raytrain: checkpoint {result.checkpoint_path}")
    return 0


def _refused(error: ConfigError) -> int:
    say(f"raytrain: error: {error}", err=True)
    return 2


def _interrupted_early(by_sigterm: bool = False) -> int:
    say(f"raytrain: interrupted{' by SIGTERM' if by_sigterm else ''} before training started", err=True)
    return 143 if by_sigterm else 130


if __name__ == "__main__":
    code = main()
    if code in (130, 143):  # stopped by Ctrl-C or SIGTERM: one more Ctrl-C must not break Ray's shutdown at exit
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a traceback from its atexit hook; it takes a second or two)
    sys.exit(code)
