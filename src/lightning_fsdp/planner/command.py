"""``lightning-fsdp plan``: the command-line face of :func:`~lightning_fsdp.planner.plan_memory`.

The options carry the strategy's argument names in their YAML spellings: ``--sharding-strategy FULL_SHARD``,
``--auto-wrap-policy mypkg.model.Block`` (repeat it, or separate names with commas), ``--device-mesh 2,4``. The
mapping forms take JSON: ``--activation-checkpointing-policy '{"every": 2, "save_ops": "default"}'``,
``--reshard-after-forward '{"root": true, "Block": 2}'``. Tensor parallelism: ``--tensor-parallel-size 2`` with
``--tensor-parallel-plan auto``, a JSON mapping (``'{"blocks.*.mlp.up": "colwise"}'``) or ``MODULE:NAME`` naming a
dict or a callable, as the strategy's ``tensor_parallel_plan`` takes them.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import re
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

from lightning_fsdp.checkpoint.convert import UsageError, parse_size

__all__ = ["add_plan_command", "positive_int", "byte_size"]


def add_plan_command(commands: Any) -> None:
    from lightning_fsdp.engine.config import ShardingStrategy
    from lightning_fsdp.engine.precision import SUPPORTED_PRECISION

    strategies = ", ".join(s.value for s in ShardingStrategy)
    plan = commands.add_parser(
        "plan", help="plan the memory of one training step per rank, before launching",
        description="Plan the memory one training step (forward, backward, optimizer step) needs on each rank, on"
                    " fake tensors: nothing is allocated, and no GPU is needed.",
    )
    plan.add_argument("--model", required=True, metavar="MODULE:FACTORY",
                      help="a callable returning the nn.Module, e.g. mypkg.models:build or path/to/file.py:build")
    plan.add_argument("--inputs", required=True, metavar="MODULE:FACTORY",
                      help="a callable returning one rank's batch: a tensor, a tuple (positional arguments) or a dict"
                           " (keyword arguments)")
    plan.add_argument("--world-size", required=True, type=positive_int("--world-size 8"), metavar="N",
                      help="the number of ranks (processes) of the run, over all nodes; an integer >= 1")
    plan.add_argument("--num-nodes", type=positive_int("--num-nodes 2"), default=1, metavar="N",
                      help="the number of nodes the ranks are spread over; an integer >= 1 (default: 1)")
    plan.add_argument("--sharding-strategy", default="FULL_SHARD", metavar="STRATEGY",
                      help=f"one of {strategies} (any case; default: FULL_SHARD)")
    plan.add_argument("--auto-wrap-policy", action="append", metavar="DOTTED_NAME",
                      help="module classes that become FSDP units, or 'auto' (default)")
    plan.add_argument("--activation-checkpointing-policy", action="append", metavar="DOTTED_NAME|JSON",
                      help="module classes to checkpoint, or a JSON mapping with 'blocks', 'every' and 'save_ops'")
    plan.add_argument("--reshard-after-forward", type=_reshard, metavar="true|false|INT|JSON",
                      help="after forward: reshard, keep, reshard to groups of INT ranks, or a JSON mapping per unit")
    plan.add_argument("--forward-prefetch", type=int, metavar="N", help="units ahead to all-gather in forward; an integer >= 0")
    plan.add_argument("--backward-prefetch", type=int, metavar="N", help="units ahead to all-gather in backward; an integer >= 0")
    plan.add_argument("--precision", default="32-true", metavar="PRECISION",
                      help=f"one of {', '.join(SUPPORTED_PRECISION)} (default: 32-true)")
    plan.add_argument("--cpu-offload", action="store_true",
                      help="keep parameters, gradients and optimizer states in CPU memory between uses")
    plan.add_argument("--device-mesh", type=_mesh, metavar="REPLICATE,SHARD",
                      help="the 2-D mesh of HYBRID_SHARD: replica groups, then ranks per shard group, e.g. 2,4"
                           " (default: one shard group of all ranks)")
    plan.add_argument("--tensor-parallel-size", type=positive_int("--tensor-parallel-size 2"), metavar="K",
                      help="ranks per tensor-parallel group, a divisor of --world-size; the mesh becomes (shard, tp)"
                           " (default: 1, no tensor parallelism)")
    plan.add_argument("--tensor-parallel-plan", metavar="auto|JSON|MODULE:NAME",
                      help="what to split over each group: 'auto' (a Hugging Face model's own tp_plan), a JSON mapping"
                           """ of module-name patterns to styles, e.g. '{"blocks.*.mlp.up": "colwise"}', or a dict or"""
                           " callable (module, tp_mesh) named as mypkg.plans:PLAN or path/to/file.py:PLAN")
    plan.add_argument("--accumulate-grad-batches", type=positive_int("--accumulate-grad-batches 4"), default=1,
                      metavar="N",
                      help="batches per optimizer step, as Trainer(accumulate_grad_batches=N); an integer >= 1")
    plan.add_argument("--optimizer", default="adamw", choices=("adamw", "adam", "sgd"),
                      help="the optimizer whose states are planned: adamw, adam or sgd (default: adamw)")
    plan.add_argument("--memory-budget", type=byte_size, metavar="BYTES",
                      help="per-rank budget (e.g. 80GB, 70GiB or bytes): if the plan does not fit, plan what would")
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    plan.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from lightning_fsdp.planner import plan_memory, suggest
    from lightning_fsdp.planner.step import PlanningError

    model = _load_callable(args.model, "--model")
    inputs = _load_callable(args.inputs, "--inputs")
    options: dict[str, Any] = {"sharding_strategy": args.sharding_strategy, "cpu_offload": args.cpu_offload}
    for name in ("auto_wrap_policy", "activation_checkpointing_policy"):
        values = getattr(args, name) or []
        if len(values) == 1 and values[0].lstrip().startswith("{"):
            options[name] = _json(values[0], name)
            continue
        names = [n for value in values for n in value.split(",") if n]
        if names:
            options[name] = names[0] if names == ["auto"] else names
    for name in ("device_mesh", "reshard_after_forward", "forward_prefetch", "backward_prefetch",
                 "tensor_parallel_size"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    if args.tensor_parallel_plan is not None:
        options["tensor_parallel_plan"] = _tensor_parallel_plan(args.tensor_parallel_plan)
    try:
        # Warnings (a policy that selects nothing) are held back: a failed plan prints its one error line only, a
        # plan that succeeds prints each warning as one line before the plan.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            plan = plan_memory(model, inputs, world_size=args.world_size, num_nodes=args.num_nodes,
                               precision=args.precision, optimizer=args.optimizer,
                               accumulate_grad_batches=args.accumulate_grad_batches, **options)
            suggestions = []
            if args.memory_budget is not None and not plan.fits(args.memory_budget):
                suggestions = suggest(model, inputs, plan, args.memory_budget)
        for message in dict.fromkeys(" ".join(str(w.message).split()) for w in caught):
            print(f"lightning-fsdp: warning: {message}", file=sys.stderr)
    except PlanningError as err:
        # The user's code failed: say which option named it. A forward that fails is most often a batch that does
        # not fit the model, so it names both.
        option = {"model factory": f"--model {args.model!r}", "batch factory": f"--inputs {args.inputs!r}"}.get(
            err.phase, f"--model {args.model!r} with --inputs {args.inputs!r}")
        raise UsageError(f"{option}: {err}") from err
    except (ValueError, TypeError) as err:
        raise UsageError(_as_option_message(str(err))) from err
    if args.json:
        out = plan.to_dict()
        if args.memory_budget is not None:
            out["memory_budget"] = args.memory_budget
            out["fits"] = plan.fits(args.memory_budget)
            out["suggestions"] = [{"change": s.change, "peak_bytes": s.plan.max_peak_bytes, "fits": s.fits}
                                  for s in suggestions]
        print(json.dumps(out, indent=2))
        return 0
    print(plan.render())
    if args.memory_budget is not None:
        print(f"\n  budget {args.memory_budget} bytes: " + ("fits" if plan.fits(args.memory_budget) else "does not fit"))
        for s in suggestions:
            print(f"    {'fits' if s.fits else 'no  '}  {s.change}: peak {s.plan.max_peak_bytes} bytes")
        first = next((s for s in suggestions if s.fits), None)
        if suggestions:
            print(f"  cheapest change that fits: {first.change}" if first else "  nothing tried fits; see above")
    return 0


def _load_callable(spec: str, option: str) -> Callable[[], Any]:
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"{option} {spec!r} is not MODULE:FACTORY. HINT: name a callable, e.g."
                         f" `{option} mypkg.models:build` or `{option} path/to/train.py:build`.")
    factory = _load_attribute(spec, option)
    if not callable(factory):
        raise UsageError(f"{option} {spec!r}: {module_name!r} has no callable {attr!r}. HINT: name a function that"
                         " takes no arguments, e.g. `def build(): return GPT(config)`.")
    return factory


def _tensor_parallel_plan(text: str) -> Any:
    """``auto``, a JSON mapping, or a dict or callable named as ``MODULE:NAME`` (as the strategy takes them)."""
    option = "--tensor-parallel-plan"
    if text.strip() == "auto":
        return "auto"
    if text.lstrip().startswith("{"):
        return _json(text, "tensor_parallel_plan", """'{"blocks.*.mlp.up": "colwise"}'""")
    module_name, sep, attr = text.rpartition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"{option} {text!r} is not 'auto', a JSON mapping or MODULE:NAME. HINT: e.g. {option} auto,"
                         f""" {option} '{{"blocks.*.mlp.up": "colwise"}}' or {option} path/to/train.py:PLAN.""")
    plan = _load_attribute(text, option)
    if not (isinstance(plan, dict) or callable(plan)):
        what = f"has no {attr!r}" if plan is None else f"holds {attr!r} as {type(plan).__name__}"
        raise UsageError(f"{option} {text!r}: {module_name!r} {what}; a plan is a dict or a callable. HINT: name a"
                         """ dict of module-name patterns to styles, e.g. `PLAN = {"blocks.*.mlp.up": "colwise"}`,"""
                         " or a function `(module, tp_mesh) -> None`.")
    return plan


def _load_attribute(spec: str, option: str) -> Any:
    """The object ``MODULE:NAME`` (or ``path/to/file.py:NAME``) names; None if the module has no such name."""
    module_name, _, attr = spec.rpartition(":")
    try:
        if module_name.endswith(".py"):
            module = _load_file(Path(module_name), spec, option)
        else:
            sys.path.insert(0, str(Path.cwd()))
            module = importlib.import_module(module_name)
    except (ModuleNotFoundError, FileNotFoundError) as err:
        inside = isinstance(err, ModuleNotFoundError) and (
            module_name.endswith(".py") or err.name not in _prefixes(module_name))
        if inside:  # the module was found, but something it imports is missing
            raise UsageError(_import_failed(spec, option, err)) from err
        raise UsageError(f"{option} {spec!r}: cannot import {module_name!r} ({err}). HINT: run from the directory"
                         " that contains the package, or give a file path such as `path/to/train.py:build`.") from err
    except UsageError:
        raise
    except Exception as err:  # a SyntaxError, or whatever the module's own top level raised
        raise UsageError(_import_failed(spec, option, err)) from err
    return getattr(module, attr, None)


def _load_file(path: Path, spec: str, option: str) -> Any:
    """The module of a file path, loaded once and registered in ``sys.modules`` under the file's stem, so that
    ``--model model.py:build --auto-wrap-policy model.Block`` names the very class the factory uses (a second copy,
    imported by the policy, would match no module of the model). ``--inputs`` from the same file reuses it."""
    if not path.is_file():
        raise FileNotFoundError(f"No such file: {str(path)!r}")
    resolved = path.resolve()
    name = path.stem
    loaded = sys.modules.get(name)
    if loaded is not None:
        if _file_of(loaded) == resolved:
            return loaded
        where = _file_of(loaded) or "built in"
        raise UsageError(
            f"{option} {spec!r}: the file's name {name!r} is already the name of an imported module ({where}), so"
            f" its classes could not be named as {name}.ClassName. HINT: rename the file, e.g. to"
            f" `{name}_model.py`."
        )
    sys.path.insert(0, str(resolved.parent))  # what `python FILE.py` does: the file's own imports resolve beside it
    module_spec = importlib.util.spec_from_file_location(name, resolved)
    if module_spec is None or module_spec.loader is None:
        raise UsageError(f"{option} {spec!r}: {str(path)!r} cannot be loaded as a Python module. HINT: give a `.py`"
                         " file, e.g. `path/to/train.py:build`.")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _file_of(module: Any) -> Path | None:
    file = getattr(module, "__file__", None)
    return Path(file).resolve() if file else None


def _prefixes(module_name: str) -> set[str]:
    parts = module_name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


def _import_failed(spec: str, option: str, err: BaseException) -> str:
    """One line for a module that exists but fails while importing: the exception and the user's line."""
    if isinstance(err, SyntaxError):
        where = f"{err.filename}:{err.lineno}"
        return (f"{option} {spec!r}: syntax error at {where}: {err.msg}. HINT: fix that line; `python -m py_compile"
                f" {err.filename}` checks the file.")
    frames = traceback.extract_tb(err.__traceback__)
    user = [f for f in frames if "importlib" not in f.filename and "lightning_fsdp" not in f.filename]
    where = f" at {user[-1].filename}:{user[-1].lineno}" if user else ""
    message = " ".join(str(err).split())
    return (f"{option} {spec!r}: importing it failed{where}: {type(err).__name__}: {message}. HINT: importing the"
            " module must succeed on its own; `python -c 'import MODULE'` (or running the file) shows the traceback.")


# The option types of the whole command: `plan`'s here, and `cli.py`'s other commands import them (cli.py imports this
# module, never the other way round).


def positive_int(example: str) -> Callable[[str], int]:
    """The ``type=`` of an option that takes a whole number >= 1; ``example`` is that option with a good value, for
    the HINT (argparse names the option in front of the message)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected a whole number of at least 1. HINT:"
                                             f" e.g. {example}")
        return value

    return parse


def byte_size(text: str) -> int:
    """The ``type=`` of an option that takes a size in bytes (``500MB``, ``2GiB``): :func:`parse_size`."""
    try:
        return parse_size(text)
    except UsageError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _mesh(text: str) -> tuple[int, int]:
    parts = text.replace("x", ",").split(",")
    try:
        replicate, shard = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not REPLICATE,SHARD. HINT: two integers, e.g. 2,4 for 2"
                                         " replicas of 4-rank shard groups.") from None
    return replicate, shard


def _json(text: str, name: str, example: str = """'{"every": 2, "save_ops": "default"}'""") -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise UsageError(f"--{name.replace('_', '-')} {text!r} is not valid JSON ({err}). HINT: quote keys and strings"
                         f" with double quotes, e.g. {example}.") from None


def _reshard(text: str) -> Any:
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered.lstrip("-").isdigit():
        return int(lowered)
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not true, false, an int or a JSON mapping. HINT: e.g."
                                         """ '{"root": true, "Block": 2}' (keys and strings in double quotes).""") from None


def _as_option_message(message: str) -> str:
    """The library's messages name arguments as in Python (`auto_wrap_policy=...`); name the option as typed."""
    for name in ("sharding_strategy", "auto_wrap_policy", "activation_checkpointing_policy", "device_mesh",
                 "precision", "world_size", "num_nodes", "optimizer", "reshard_after_forward", "forward_prefetch",
                 "backward_prefetch", "tensor_parallel_size", "tensor_parallel_plan"):
        option = f"--{name.replace('_', '-')}"
        message = message.replace(f"`{name}=", f"`{option} ")
        # A fix written for Python (`Fabric(precision='bf16-mixed')`) becomes the option that does it.
        message = re.sub(rf"`(?:Fabric|Trainer|FSDPStrategy)\({name}=([^`]*)\)`", rf"`{option} \1`", message)
    # A mapping written for Python (`--tensor-parallel-plan {'blocks.*.up': 'colwise'}`) becomes the quoted JSON the
    # option takes.
    return re.sub(r"`(--[a-z-]+) (\{[^`]*\})`", _as_shell_json, message)


def _as_shell_json(match: re.Match) -> str:
    try:
        value = ast.literal_eval(match.group(2))
    except (ValueError, SyntaxError):
        return match.group(0)
    return f"`{match.group(1)} '{json.dumps(value)}'`"
