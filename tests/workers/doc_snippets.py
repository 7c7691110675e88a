"""Run documentation snippets (``tests/doc_snippets.py``) as cases: each in a fresh namespace, as ``__main__``.

Started by ``tests/test_docs.py``: under torchrun for the snippets marked ``ranks=N``, as a plain process for the
rest. Every rank runs a snippet in the same directory (``$LFSDP_TEST_OUT/<snippet>``), so a checkpoint that one
snippet saves from several ranks is one checkpoint. When the launch has several ranks, the default process group is
created here first with the harness's short timeout: a snippet that fails on one rank then cannot leave its peer
waiting for the default 30 minutes; the strategies in the snippets use that group as they would their own.

A snippet's own asserts check what it shows; a few strategy options have effects that a user's script cannot
assert without torch's private state, and those are checked here after the snippet ran (:func:`_check_effects`):
where a snippet gives a strategy ``forward_prefetch``/``backward_prefetch`` above FSDP2's defaults, every set-up
model in its namespace registered the next units; where it gives ``storage_options``, they are what the strategy's
saves and loads hand to the filesystem. Without these the performance and object-storage snippets passed with the
option ignored (issue 42.11).

A snippet is a user's script, whose process would end with it: what such a script may leave to its process's end
(the working directory, and signal handlers, as ``Preemption`` installs them for the whole run) is put back after
it, so the next snippet starts as its own process would. Anything else a snippet leaves behind fails it (the
isolation guard of ``harness.run_cases``).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import torch.distributed as dist
from harness import CASES, TIMEOUT, run_cases


def _case(snippet: dict):
    def run() -> dict:
        where = Path(os.environ["LFSDP_TEST_OUT"]) / "cwd" / snippet["name"]
        where.mkdir(parents=True, exist_ok=True)
        before = Path.cwd()
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2,
                                                            signal.SIGINT)}
        os.chdir(where)
        try:
            code = compile(snippet["code"], f"{snippet['path']}:{snippet['line']}", "exec")
            namespace = {"__name__": "__main__", "__file__": str(where / "snippet.py")}
            exec(code, namespace)  # noqa: S102 - our own docs
        finally:
            os.chdir(before)
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        return {"ran": f"{snippet['path']}:{snippet['line']}", "effects": _check_effects(snippet["code"], namespace)}

    run.__name__ = snippet["name"]
    return run


def _ours(namespace: dict) -> tuple[list, list]:
    """The strategies of this package in a snippet's namespace (as values, or as a Fabric's or Trainer's strategy),
    and the FSDP2 roots of its models (a Fabric-wrapped model's module too)."""
    from torch import nn
    from torch.distributed.fsdp import FSDPModule

    from lightning_fsdp._fronts.mixin import FrontMixin

    strategies, roots = [], []
    for value in namespace.values():
        for candidate in (value, getattr(value, "strategy", None)):
            if isinstance(candidate, FrontMixin) and all(candidate is not s for s in strategies):
                strategies.append(candidate)
        if isinstance(value, nn.Module):
            module = getattr(value, "module", value)
            if isinstance(module, FSDPModule) and all(module is not r for r in roots):
                roots.append(module)
    return strategies, roots


def _registered_prefetch(root) -> dict:
    """Each unit's registered forward and backward prefetch targets (FSDP2 keeps them in its state), by position in
    the package's own execution order (the root is -1), and the backward order in those positions."""
    from lightning_fsdp.engine.prefetch import execution_order

    forward_order, backward_order = execution_order(root)
    index = {id(u._get_fsdp_state()): i for i, u in enumerate(forward_order)}
    units = [root, *forward_order]
    registered = {}
    for way in ("forward", "backward"):
        registered[way] = {index.get(id(u._get_fsdp_state()), -1):
                           [index[id(t)] for t in getattr(u._get_fsdp_state(), f"_states_to_{way}_prefetch")]
                           for u in units}
    return {**registered, "backward_order": [index[id(u._get_fsdp_state())] for u in backward_order]}


def _given(code: str) -> dict:
    """The literal values the snippet's code gives ``FSDPStrategy(...)`` for the options checked here: read from the
    code, not from the strategy, so that an option the strategy drops is still expected."""
    import ast

    given: dict = {}
    for node in ast.walk(ast.parse(code)):
        name = getattr(getattr(node, "func", None), "id", None) or getattr(getattr(node, "func", None), "attr", None)
        if isinstance(node, ast.Call) and name == "FSDPStrategy":
            for keyword in node.keywords:
                if keyword.arg in ("storage_options", "forward_prefetch", "backward_prefetch"):
                    try:
                        given.setdefault(keyword.arg, []).append(ast.literal_eval(keyword.value))
                    except ValueError:  # not a literal (a variable, a bad value the snippet shows refused)
                        pass
    return given


def _check_effects(code: str, namespace: dict) -> dict:
    """What the options the snippet gave its strategies did (see the module's docstring); raises when one did
    nothing."""
    from lightning_fsdp.checkpoint.io.store import store_for
    from lightning_fsdp.engine.prefetch import BACKWARD_DEFAULT, FORWARD_DEFAULT

    given, (strategies, roots) = _given(code), _ours(namespace)
    seen: dict = {}
    for options in [o for o in given.get("storage_options", []) if isinstance(o, dict)]:
        handed = [s._storage_options(None) for s in strategies]  # what save_checkpoint and load_checkpoint pass on
        assert options in handed, f"storage_options={options} given, and the strategies hand on {handed}"
        fs_options = store_for("s3://snippet-bucket/run", options).fs.storage_options
        missing = {k: v for k, v in options.items() if fs_options.get(k) != v}
        assert not missing, f"storage_options {missing} did not reach the filesystem, which got {fs_options}"
        seen.setdefault("storage_options", []).append(sorted(options))
    # Depths above FSDP2's defaults (forward 0, backward 1) register units (True is 1); the defaults register none.
    depths = {way: int(depth) for way, default in (("forward", FORWARD_DEFAULT), ("backward", BACKWARD_DEFAULT))
              for depth in given.get(f"{way}_prefetch", []) if isinstance(depth, int) and depth > default}
    if depths:
        assert roots, f"{depths} given, and no set-up model in the snippet to check them on"
    for root in roots if depths else []:
        registered = _registered_prefetch(root)
        orders = {"forward": sorted(k for k in registered["forward"] if k >= 0),
                  "backward": registered["backward_order"]}
        for way, depth in depths.items():
            order = orders[way]
            expected = {-1: order[:depth], **{u: order[n + 1:n + 1 + depth] for n, u in enumerate(order)}}
            assert registered[way] == expected, (
                f"{way}_prefetch={depth}: the units registered {registered[way]} (by position in execution order, the"
                f" root -1), not the next {depth} of each: {expected}")
        seen.setdefault("prefetch", []).append({k: v for k, v in registered.items() if k != "backward_order"})
    return seen


if __name__ == "__main__":
    snippets = json.loads(Path(os.environ["LFSDP_SNIPPETS"]).read_text())
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo", timeout=TIMEOUT)
    CASES.extend(_case(s) for s in snippets)
    run_cases()
