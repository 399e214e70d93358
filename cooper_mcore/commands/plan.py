"""``cooper plan``: per-GPU memory of each phase of a run, and the offloads it needs."""

from __future__ import annotations

import argparse
import json
import os

from cooper_mcore.config.checks import Elsewhere, validate
from cooper_mcore.config.schema import load_config
from cooper_mcore.models.arch import ArchSpec, load_hf_config
from cooper_mcore.planner.comparison import check_plan
from cooper_mcore.planner.plan import AssistantSpec, PlanOptions
from cooper_mcore.planner.plan import plan as plan_memory
from cooper_mcore.planner.report import find_shapes, format_plan, plan_to_dict


def plan(args: argparse.Namespace) -> None:
    cfg = load_config(args.config, args.overrides)
    policy_shape, rm_shape, notes = find_shapes(cfg, args.policy_config, args.rm_config)
    policy, rm = policy_shape.arch, rm_shape.arch if rm_shape is not None else None
    # the checks `cooper train` runs, with these shapes: a run the trainer refuses does not fit
    validate(cfg, args.gpus_per_node * args.nodes, Elsewhere(policy, rm))
    assistant: AssistantSpec | str = "none" if args.no_assistant else "auto"
    if not args.no_assistant and (args.assistant_config or args.assistant_tp or args.assistant_mem_fraction):
        path = args.assistant_config
        arch = policy
        if path:  # an HF config file, or the model folder that holds its config.json
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as f:
                    arch = ArchSpec.from_hf_config(json.load(f))
            else:
                arch = ArchSpec.from_hf_config(load_hf_config(path))
        assistant = AssistantSpec(arch, tp=args.assistant_tp or cfg.parallel.tp,
                                  mem_fraction=args.assistant_mem_fraction)
    options = PlanOptions(gpus_per_node=args.gpus_per_node, gpu_memory_gib=args.gpu_memory_gib, nodes=args.nodes,
                          prompt_tokens=args.prompt_tokens, overhead_gib=args.overhead_gib, recompute=args.recompute,
                          assistant=assistant)
    result = plan_memory(cfg, policy, rm, options)
    # one rank of the real layout through a whole step on fake tensors, beside the plan
    check = check_plan(cfg, policy_shape, rm_shape, options) if args.simulate else None
    if args.json:
        doc = plan_to_dict(result, cfg, notes)
        if check is not None:
            doc["simulation"] = check.to_dict()
        print(json.dumps(doc, indent=2), flush=True)
    else:
        print(format_plan(result, cfg, notes), flush=True)  # the report table
        if check is not None:
            print("\n" + check.format(), flush=True)
