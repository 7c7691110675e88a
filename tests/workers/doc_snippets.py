"""Run documentation snippets (``tests/doc_snippets.py``) as cases: each in a fresh namespace, as ``__main__``.

Started by ``tests/test_docs.py``: under torchrun for the snippets marked ``ranks=N``, as a plain process for the
rest. Every rank runs a snippet in the same directory (``$LFSDP_TEST_OUT/<snippet>``), so a checkpoint that one
snippet saves from several ranks is one checkpoint. When the launch has several ranks, the default process group is
created here first with the harness's short timeout: a snippet that fails on one rank then cannot leave its peer
waiting for the default 30 minutes; the strategies in the snippets use that group as they would their own.

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
            exec(code, {"__name__": "__main__", "__file__": str(where / "snippet.py")})  # noqa: S102 - our own docs
        finally:
            os.chdir(before)
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        return {"ran": f"{snippet['path']}:{snippet['line']}"}

    run.__name__ = snippet["name"]
    return run


if __name__ == "__main__":
    snippets = json.loads(Path(os.environ["LFSDP_SNIPPETS"]).read_text())
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo", timeout=TIMEOUT)
    CASES.extend(_case(s) for s in snippets)
    run_cases()
