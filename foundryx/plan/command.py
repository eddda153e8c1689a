"""``foundryx plan CONFIG [key=value ...]``: the command line of the planner (key=value
overrides anywhere on the line, see :mod:`foundryx.cli`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from foundryx.config.load import precheck, read_resolved
from foundryx.plan.gpus import DEFAULT_GPU, DEFAULT_MFU, GPUS, GiB
from foundryx.plan.node import machine, processes_per_node, shape_override


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="per-device and host memory, load time and throughput of "
                       "a run before launch: does it fit, and what to change when it does not")
    p.add_argument("config", help="run config YAML (its model, precision, sharding, microbatch, "
                   "peft_config, frozen_base, optimizer)")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the run config")
    p.add_argument("--gpus", type=int, default=None, help="devices per node (default: the config's node.gpus, else 1)")
    p.add_argument("--nodes", type=int, default=None, help="nodes (default: the config's node.nodes, else 1)")
    p.add_argument("--gpu", default=None, help=f"the device: {', '.join(GPUS)} (default: the "
                   f"config's node.gpu, else {DEFAULT_GPU}); cpu: a CPU process (no GPU context or allocator margin), of "
                   "this machine's memory / --gpus unless --gpu-memory, also the default for a "
                   "config with device: cpu")
    p.add_argument("--gpu-memory", default=None, help="memory per device, e.g. 80GB or 79.1GiB "
                   "(default: the --gpu's)")
    p.add_argument("--host-memory", default=None, help="host (CPU) memory per node, e.g. 2TB "
                   "(default: the --gpu's reference node's, e.g. 2 TB for a DGX H100; this "
                   "machine's for a CPU run; foundryx/plan/gpus.py lists them)")
    p.add_argument("--read-rate", default=None, help="how fast a node reads the pretrained "
                   "weights, e.g. 2GB/s (default: the --gpu's reference node's local NVMe, "
                   "assumed; 1GB/s for a CPU run)")
    p.add_argument("--mfu", type=float, default=None,
                   help="model FLOPs utilisation for the throughput estimate (default: the one "
                   "measured for this GPU and kind of run, foundryx/plan/speed.py, else "
                   f"{DEFAULT_MFU})")
    p.add_argument("--tp", type=int, default=None, help="plan at this tensor-parallel degree "
                   "(default: the config's parallelism.tp, else 1)")
    p.add_argument("--search", choices=("microbatch", "tp", "max_seq_len"), default=None,
                   help="microbatch: print the largest microbatch that fits; tp: the run at "
                   "each TP degree (divisors of --gpus dividing the heads and kv heads) on the "
                   "same devices and global batch: memory, communication, step time, verdict; "
                   "max_seq_len: the longest sequence that fits the device and the node, and "
                   "what runs out past it")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(fn=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    if (args.nodes or 1) >= 1 and (args.gpus is None or args.gpus >= 1):  # else make_plan says so
        # before torch: the config's mistakes in a fraction of a second, for the machine and
        # the model shape make_plan will plan (the recipe's node, its release's shape)
        data, _ = read_resolved(Path(args.config), args.overrides)
        target = machine(data.get("node"), args.gpu, args.gpus, args.nodes, args.host_memory)
        shape, _ = shape_override(args.config, data.get("model"))
        world = processes_per_node(target.gpus) * target.nodes
        precheck(args.config, [*args.overrides, *shape], world_size=world,
                 component_sections=("model", "optimizer"))
    from foundryx.plan import planner, render  # torch + transformers: only for a plan

    plan = planner.make_plan(args.config, args.overrides, gpus=args.gpus, nodes=args.nodes, gpu=args.gpu,
                     gpu_memory=args.gpu_memory, mfu=args.mfu, host_memory=args.host_memory,
                     read_rate=args.read_rate, tp=args.tp)
    if args.search == "tp":
        print(render.render_tp_table(plan))
        return 0 if any(o.per_device_bytes <= plan.capacity for o in plan.tp_options) else 1
    if args.search == "max_seq_len":
        from foundryx.plan.length import describe

        answer = plan.longest_sequence()
        if args.json:
            print(json.dumps({**plan.to_json(), "longest_sequence": answer.to_json()}, indent=2))
        else:
            print(describe(answer, plan.device, plan.capacity / GiB, plan.seq_key))
        return 0 if answer.seq_len else 1
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    elif args.search == "microbatch":
        mb = plan.largest_microbatch
        print(f"largest microbatch that fits on {plan.device} "
              f"({plan.capacity / GiB:,.2f} GiB): {mb or 'none (even 1 does not fit)'}")
    else:
        print(render.render(plan))
    return 0 if plan.fits else 1
