"""Launch test workers over and over and count the launches that did not exit 0: the check for rare crashes at exit,
which one suite run seldom shows.

    python tests/repeat_launches.py patterns.py,trainer_patterns.py,meta_init.py --rounds 8 --parallel 2

Each round launches every named worker script of ``tests/workers`` on 2 ranks; ``--parallel`` streams run side by
side (load makes exits race the way they do on a busy machine). A launch counts as an abort when torchrun's exit
status is not 0 although every case passed; logs of failed launches are kept in ``--logs``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from launch import LAUNCH_TIMEOUT_S, torchrun, worker_env


def stream(scripts: list[str], rounds: int, folder: Path, logs: Path, index: int) -> list[tuple[str, int]]:
    outcomes = []
    for r in range(rounds):
        for script in scripts:
            out = folder / f"{index}-{r}-{Path(script).stem}"
            proc = subprocess.run(torchrun(script, 2), env=worker_env(out), capture_output=True, text=True,
                                  timeout=LAUNCH_TIMEOUT_S)
            outcomes.append((script, proc.returncode))
            print(f"stream {index} round {r} {script}: exit {proc.returncode}", flush=True)
            if proc.returncode != 0:
                (logs / f"{index}-{r}-{Path(script).stem}.log").write_text(proc.stdout + proc.stderr)
            shutil.rmtree(out, ignore_errors=True)
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scripts", help="worker scripts in tests/workers, comma-separated")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--logs", type=Path, default=Path("repeat-launch-logs"))
    args = parser.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    scripts = args.scripts.split(",")
    with tempfile.TemporaryDirectory() as folder, ThreadPoolExecutor(args.parallel) as pool:
        streams = [pool.submit(stream, scripts, args.rounds, Path(folder), args.logs, i) for i in range(args.parallel)]
        outcomes = [o for s in streams for o in s.result()]
    failed = [o for o in outcomes if o[1] != 0]
    print(f"{len(failed)} of {len(outcomes)} launches did not exit 0" + (f" (logs in {args.logs})" if failed else ""))
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
