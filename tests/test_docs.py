"""The documentation cannot rot: every Python block of the README and of ``docs/`` runs, the site builds in strict
mode, the README's links land on real pages and anchors, and the benchmark table is what the run of record gives.

How blocks are found and marked: ``tests/doc_snippets.py``.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

import forkserver
from doc_snippets import ROOT, all_snippets, documents, parse
from launch import LAUNCH_TIMEOUT_S, PROCESS_ENV, Launch, pooled, script_env, torchrun, worker_env

SNIPPETS = all_snippets()
BY_RANKS = {n: [s for s in SNIPPETS if s.kind == "python" and s.ranks == n] for n in (1, 2, 4)}


def _run(snippets, nproc: int, tmp: Path) -> Launch:
    tmp.mkdir(parents=True, exist_ok=True)
    listing = tmp / "snippets.json"
    listing.write_text(json.dumps([dict(s.to_dict(), name=s.name) for s in snippets]))
    out = tmp / "out"
    env = worker_env(out, LFSDP_SNIPPETS=str(listing))
    script = str(Path(__file__).parent / "workers" / "doc_snippets.py")
    command = torchrun("doc_snippets.py", nproc) if nproc > 1 else [forkserver.python(), script]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    return Launch(out=out, world_size=nproc, log=proc.stdout + proc.stderr, returncode=proc.returncode)


def _two_rank_snippets(out: Path) -> dict[str, str]:
    """The environment of the launch of the 2-rank snippets: the file listing them, written into its folder."""
    listing = out / "snippets.json"
    listing.write_text(json.dumps([dict(s.to_dict(), name=s.name) for s in BY_RANKS[2]]))
    return {"LFSDP_SNIPPETS": str(listing)}


# The 2-rank snippets (most of them: 12 of 14, and 11 to 13 s of the main process's time as a launch of its own) run in
# a background launch pool of their own (their listing is the pool's environment, written when its turn comes).
snippets2 = pooled("doc_snippets.py", 2, name="snippets2", env_from=_two_rank_snippets)


@pytest.fixture(scope="module")
def launches(tmp_path_factory, snippets2):
    """The launch of each rank count: the 2-rank snippets' pool (``snippets2``), the others started lazily."""
    cache: dict[int, Launch] = {2: snippets2}

    def get(nproc: int) -> Launch:
        if nproc not in cache:
            cache[nproc] = _run(BY_RANKS[nproc], nproc, tmp_path_factory.mktemp(f"snippets{nproc}"))
        return cache[nproc]

    return get


def test_there_are_snippets_to_run():
    """The control for the parametrized test below: the parser must find the blocks the README is known to hold."""
    readme = [s for s in SNIPPETS if s.path == "README.md"]
    assert {s.kind for s in readme} == {"python", "cli-config"}, readme
    assert len([s for s in SNIPPETS if s.kind == "python"]) >= 8


def asserts_of(code: str) -> int:
    """How many ``assert`` statements a snippet holds (a ``raise AssertionError`` or a print checks nothing)."""
    return sum(isinstance(node, ast.Assert) for node in ast.walk(ast.parse(code)))


def test_every_python_snippet_asserts_what_it_shows():
    """A snippet that only runs (or prints) passes with what it shows broken: each one asserts its point (a load
    compares the weights, a resume the step it went on from, an export the reloaded model's loss)."""
    silent = [s.name for s in SNIPPETS if s.kind == "python" and not asserts_of(s.code)]
    assert not silent, f"Python snippets without an assert: {silent}"
    assert asserts_of("x = 1\nprint(x)\nif x:\n    raise AssertionError\n") == 0  # the control
    assert asserts_of("x = 1\nassert x == 1\n") == 1


@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if s.kind == "python"], ids=lambda s: s.name)
def test_python_snippet_runs(snippet, launches):
    launches(snippet.ranks).check(snippet.name)


@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if s.kind == "cli-config"], ids=lambda s: s.name)
def test_yaml_snippet_trains(snippet, tmp_path):
    """The config trains, and each of its strategy options shows in the sharded model (read on every rank by
    tests/workers/yaml_report.py) and in the checkpoint it writes: a dropped `cpu_offload`, policy or
    `state_dict_type` fails here, not only a crash. The model has one block (`--model.layers=1`), so the default
    policy ("auto": the repeated blocks) wraps none, and an `auto_wrap_policy` that is ignored shows."""
    config = tmp_path / "config.yaml"
    config.write_text(snippet.code)
    report = tmp_path / "report"
    workers = str(Path(__file__).parent / "workers")
    env = script_env(LFSDP_YAML_REPORT=str(report),
                     PYTHONPATH=os.pathsep.join(filter(None, [workers, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [forkserver.python(), str(ROOT / "examples" / "cli_train.py"), "fit", "--config", str(config),
         "--trainer.max_steps=2", "--trainer.limit_val_batches=1", f"--trainer.default_root_dir={tmp_path / 'runs'}",
         "--model.layers=1",
         "--trainer.callbacks+=yaml_report.StrategyReport"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, start_new_session=True,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    trainer = yaml.safe_load(snippet.code)["trainer"]
    reports = [json.loads(Path(f"{report}.rank{r}.json").read_text()) for r in range(int(trainer["devices"]))]
    assert all(r == reports[0] for r in reports), reports
    saved = sorted((tmp_path / "runs").rglob("*.ckpt"))
    _check_effects(trainer, dict(reports[0], checkpoints=["directory" if p.is_dir() else "file" for p in saved]))


def _check_effects(trainer: dict, seen: dict) -> None:
    """What each option of a YAML snippet's strategy must have done to the model; an option without a check fails."""
    args = trainer["strategy"]["init_args"]
    assert seen["strategy"] == trainer["strategy"]["class_path"], seen
    assert seen["precision"] == str(trainer.get("precision", "32-true")), seen
    checks = {
        "sharding_strategy": lambda v: seen["mesh_dim_names"] == (["replicate", "shard"] if "HYBRID" in v.upper()
                                                                  else ["shard"] if v.upper() != "NO_SHARD"
                                                                  else seen["mesh_dim_names"]),
        "device_mesh": lambda v: seen["mesh_shape"] == list(v),
        "cpu_offload": lambda v: seen["offloaded_units"] == (seen["units_with_params"] if v else 0)
                                 and seen["units_with_params"] > 0,
        "auto_wrap_policy": lambda v: {n.rsplit(".", 1)[-1] for n in v} <= set(seen["unit_classes"]),
        "activation_checkpointing_policy": lambda v: seen["checkpointed_classes"] == sorted(n.rsplit(".", 1)[-1]
                                                                                          for n in v),
        "state_dict_type": lambda v: seen["state_dict_type"] == v and seen["checkpoints"]
                                     and set(seen["checkpoints"]) == {"directory" if v == "sharded" else "file"},
    }
    unchecked = sorted(set(args) - set(checks))
    assert not unchecked, f"strategy options with no effect check in tests/test_docs.py: {unchecked}"
    failed = {k: v for k, v in args.items() if not checks[k](v)}
    assert not failed, f"options without their effect: {failed}; the sharded model: {seen}"
    if "cpu_offload" not in args:
        assert seen["offloaded_units"] == 0, seen
    if "activation_checkpointing_policy" not in args:
        assert seen["checkpointed_classes"] == [], seen


# What the prose right before a YAML snippet may say of it, and the option that must then be in the YAML (whose
# effect `_check_effects` checks): a sentence that names CPU offload above a config without it fails.
PROSE_CLAIMS = {
    r"CPU offload": lambda args: args.get("cpu_offload") is True,
    r"activation\s+checkpointing": lambda args: bool(args.get("activation_checkpointing_policy")),
    r"hybrid\s+sharding": lambda args: "HYBRID" in str(args.get("sharding_strategy", "")).upper(),
    r"\(1, 2\) mesh": lambda args: list(args.get("device_mesh", ())) == [1, 2],
    r"sharded\s+checkpoints?": lambda args: args.get("state_dict_type") == "sharded",
    r"FULL_SHARD": lambda args: str(args.get("sharding_strategy", "FULL_SHARD")).upper() == "FULL_SHARD",
}


def prose_before(snippet) -> str:
    """The paragraph right above a snippet's marker: what the page says the block does."""
    lines = (ROOT / snippet.path).read_text().splitlines()[:snippet.line - 1]
    while lines and (not lines[-1].strip() or lines[-1].lstrip().startswith("<!--")):
        lines.pop()
    paragraph = []
    while lines and lines[-1].strip():
        paragraph.insert(0, lines.pop())
    return " ".join(paragraph)


def unbacked_claims(prose: str, config: str) -> list[str]:
    args = yaml.safe_load(config)["trainer"]["strategy"].get("init_args", {})
    return [claim for claim, holds in PROSE_CLAIMS.items() if re.search(claim, prose) and not holds(args)]


@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if s.kind == "cli-config"], ids=lambda s: s.name)
def test_yaml_snippet_prose_claims_what_the_config_sets(snippet):
    """The sentence above a YAML snippet names only options the YAML sets, so the effect checks above read them."""
    prose = prose_before(snippet)
    assert not unbacked_claims(prose, snippet.code), f"{snippet.name}: {prose!r} claims what the YAML does not set"
    control = "trainer:\n  strategy:\n    init_args:\n      sharding_strategy: HYBRID_SHARD\n"
    assert unbacked_claims("hybrid sharding, with CPU offload", control) == ["CPU offload"]


def test_markers_are_checked():
    """A misspelled option, or a marker before a block that is not run, is an error rather than a silent skip."""
    with pytest.raises(ValueError, match="unknown snippet option"):
        parse("<!-- snippet: rank=2 -->\n```python\npass\n```\n", "x.md")
    with pytest.raises(ValueError, match="not run"):
        parse("<!-- snippet: ranks=2 -->\n```bash\nls\n```\n", "x.md")
    found = parse("<!-- snippet: ranks=2 -->\n\n```python\npass\n```\n\nText.\n\n```python\nx = 1\n```\n", "x.md")
    assert [(s.line, s.ranks) for s in found] == [(3, 2), (9, 1)]


def test_every_python_fence_is_collected_or_refused():
    """A Python block is a snippet whatever its fence, tag or attributes; none is skipped silently."""
    text = ("```py\na = 1\n```\n\n~~~python\nb = 2\n~~~\n\n```python title=\"x.py\"\nc = 3\n```\n\n"
            "````python3\nd = 4\n```\nstill_d = 4\n````\n\n``` { .python }\ne = 5\n```\n\n```bash\nls\n```\n")
    found = parse(text, "x.md")
    assert [(s.line, s.kind, s.code) for s in found] == [
        (1, "python", "a = 1\n"), (5, "python", "b = 2\n"), (9, "python", "c = 3\n"),
        (13, "python", "d = 4\n```\nstill_d = 4\n"), (19, "python", "e = 5\n")]
    with pytest.raises(ValueError, match="interactive session"):
        parse("```pycon\n>>> 1 + 1\n2\n```\n", "x.md")
    # And in the real documents: every line that opens a fence tagged like Python is a collected snippet.
    for doc in documents():
        relative = str(doc.relative_to(ROOT))
        lines = doc.read_text().splitlines()
        opened = {n + 1 for n, line in enumerate(lines)
                  if re.match(r"^ *(```|~~~)\s*\{?\s*\.?py", line, re.IGNORECASE)}
        collected = {s.line for s in SNIPPETS if s.path == relative and s.kind == "python"}
        assert opened <= collected, f"{relative}: Python blocks at lines {sorted(opened - collected)} are not run"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          env=dict(os.environ, NO_MKDOCS_2_WARNING="1"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return out


def test_site_builds_in_strict_mode(site):
    assert (site / "index.html").is_file()
    api = (site / "reference" / "api" / "index.html").read_text()
    assert "reshard_after_forward" in api, "the API reference did not render the strategy's docstring"


def test_api_page_renders_roles_signatures_and_functions(site):
    """Sphinx roles in docstrings show as code (docs/hooks.py), not as `:class:` text; signatures sit under their
    heading, not in it at heading size; every `:::` entry is the object named, not a module of the same name."""
    api = (site / "reference" / "api" / "index.html").read_text()
    roles = re.findall(r":(?:class|meth|func|mod|attr|data|exc|obj):", api)
    assert not roles, f"raw Sphinx roles on the API page: {roles[:5]}"
    headings = re.findall(r'<h2 id="(lightning_fsdp[^"]*)"[^>]*>(.*?)</h2>', api, re.S)
    assert len(headings) >= 10, headings
    in_heading = [name for name, html in headings if "(" in re.sub(r"<[^>]+>", "", html)]
    assert not in_heading, f"signatures rendered inside the heading: {in_heading}"
    assert "doc-object doc-module" not in api, "a `:::` entry on the API page renders a module"


def test_home_page_links_every_guide_the_readme_table_does():
    """The README's "I want to" table and the site's home table list the same pages."""
    def targets(text: str, prefix: str) -> set[str]:
        table = [line for line in text.splitlines() if line.startswith("| ")]
        return {t.removeprefix(prefix).split("#")[0] for line in table for t in re.findall(r"\]\(([^)]+)\)", line)}

    readme = targets((ROOT / "README.md").read_text(), "docs/")
    home = targets((ROOT / "docs" / "index.md").read_text(), "")
    assert readme - home == set(), f"in the README's table but not on the home page: {sorted(readme - home)}"
    assert "reference/support.md" in home, "the home page does not link the supported versions"


LINK = re.compile(r"\]\((?!https?://|mailto:)([^)#\s]+)(?:#([^)\s]+))?\)")


def test_readme_links_land_on_pages_and_anchors(site):
    """mkdocs checks the links between pages; the README is not a page, so its links are checked here."""
    bad = []
    for target, anchor in LINK.findall((ROOT / "README.md").read_text()):
        path = ROOT / target
        if not path.exists():
            bad.append(f"{target}: no such file")
            continue
        if anchor:
            rel = path.relative_to(ROOT / "docs").with_suffix("")
            html = site / (rel.parent if rel.name == "index" else rel) / "index.html"
            if f'id="{anchor}"' not in html.read_text():
                bad.append(f"{target}#{anchor}: no such anchor")
    assert not bad, bad


def test_benchmark_table_is_the_run_of_record():
    """The figures on the benchmark page are what `benchmarks/run_all.py` made of `docs/benchmarks.json`."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from run_all import markdown

    record = json.loads((ROOT / "docs" / "benchmarks.json").read_text())
    table = (ROOT / "docs" / "benchmarks-table.md").read_text()
    assert table == markdown(record["rows"], record["machine"]), "docs/benchmarks-table.md differs from the JSON"
    assert '--8<-- "docs/benchmarks-table.md"' in (ROOT / "docs" / "benchmarks.md").read_text()


def test_every_error_type_raised_is_in_troubleshooting():
    """A new exception type raised by the package needs its row in the troubleshooting guide."""
    page = (ROOT / "docs" / "guides" / "troubleshooting.md").read_text()
    raised = set()
    for source in (ROOT / "src" / "lightning_fsdp").rglob("*.py"):
        raised |= set(re.findall(r"raise (\w+(?:Error|Failure|Exception))\b", source.read_text()))
    missing = sorted(name for name in raised if f"`{name}`" not in page)
    assert not missing, f"raised but not explained in docs/guides/troubleshooting.md: {missing}"


# A sign belongs to the number unless it follows a marker (`0.05<!-- ... -->-0.11` is a range). The marker sits right
# after the number (no space); the statistic is `median` (default), `min`, `max`, `rounds` or a path into the row's
# `detail`, optionally scaled (`| detail.params / 1e6 -->M` writes 23175168 as 23.2).
MARKER = re.compile(r"<!--\s*record:(?P<body>.*?)-->", re.S)
RECORDED = re.compile(r"(?P<value>(?:(?<!>)[-+])?\d+(?:\.\d+)?)(?P<percent>%?)$")
STATISTIC = re.compile(r"(?P<stat>median|min|max|rounds|detail(?:\.\w+)+)(?:\s*/\s*(?P<scale>1e\d+))?")


def _statistic(row: dict, stat: str) -> float:
    """`median`, `min`, `max`, `rounds`, or a path into the row's `detail` (`detail.save_s`), with an optional
    divisor (`detail.params / 1e6`)."""
    m = STATISTIC.fullmatch(stat)
    value = row
    for part in m["stat"].split("."):
        value = value[part]
    return float(value) / float(m["scale"] or 1)


def recorded_figures(text: str) -> list[tuple[str, str, str, str]]:
    """(value as written, '%' or '', figure name, statistic) for every number the text marks as from the record.

    Every ``<!-- record: ... -->`` marker must sit right after a number and name a figure and a known statistic: a
    marker after a space or a letter (``1.50 <!-- record: X -->``, ``0.90x<!-- record: X -->``), or with no figure,
    is a ValueError naming the line, not a marker that checks nothing."""
    found, bad = [], []
    for m in MARKER.finditer(text):
        if text[m.start() - 1:m.start()] == "`" and text[m.end():m.end() + 1] == "`":
            continue  # the format itself, quoted as code (`<!-- record: FIGURE -->`)
        line = text.count("\n", 0, m.start()) + 1
        figure, _, stat = m["body"].partition("|")
        figure, stat = " ".join(figure.split()), " ".join(stat.split()) or "median"
        number = RECORDED.search(text[max(0, m.start() - 40):m.start()])
        if number is None:
            bad.append(f"line {line}: {text[max(0, m.start() - 20):m.end()]!r} is not right after a number")
        elif not figure:
            bad.append(f"line {line}: a marker that names no figure")
        elif not STATISTIC.fullmatch(stat):
            bad.append(f"line {line}: unknown statistic {stat!r}")
        else:
            found.append((number["value"], number["percent"], figure, stat))
    if bad:
        raise ValueError("malformed or detached record markers (write `1.11<!-- record: FIGURE -->`, the number "
                         "right before the marker): " + "; ".join(bad))
    return found


def _as_written(value: str, percent: str, measured: float) -> str:
    """The record's ratio, rounded as the text writes it: `1.11` a ratio, `+2%` the change from 1."""
    decimals = len(value.split(".")[1]) if "." in value else 0
    if percent:
        return f"{(measured - 1) * 100:+.{decimals}f}"
    return f"{measured:.{decimals}f}"


def stale_figures(text: str, rows: dict, where: str) -> list[str]:
    """What is wrong with the text's recorded figures against the record's rows (empty: all are the record)."""
    wrong = []
    for value, percent, figure, stat in recorded_figures(text):
        if figure not in rows:
            wrong.append(f"{where}: no figure {figure!r} in the record")
        elif (expected := _as_written(value, percent, _statistic(rows[figure], stat))) != value:
            wrong.append(f"{where}: {value}{percent} for {figure!r} ({stat}), the record has {expected}{percent}")
    return wrong


def test_every_recorded_figure_in_the_docs_is_the_run_of_record():
    """A number written `1.11<!-- record: FIGURE -->` (or `| min`, `| max`) in the README, docs/ or the CHANGELOG is
    that row of docs/benchmarks.json, which benchmarks/run.sh writes, rounded as written."""
    rows = {row["figure"]: row for row in json.loads((ROOT / "docs" / "benchmarks.json").read_text())["rows"]}
    wrong, found = [], 0
    for doc in [ROOT / "CHANGELOG.md", *documents()]:
        found += len(recorded_figures(doc.read_text()))
        wrong += stale_figures(doc.read_text(), rows, doc.name)
    assert found >= 7, f"only {found} recorded figures found: the marker format changed?"
    assert not wrong, wrong


def test_recorded_figures_are_read_as_written():
    """The control for the check above: a stale figure, an unknown name, and a malformed or detached marker are
    all caught."""
    text = "costs 1.04<!-- record: x --> and +2%<!-- record: y | max --> in 0.49<!-- record: z | detail.save_s --> s"
    assert recorded_figures(text) == [("1.04", "", "x", "median"), ("+2", "%", "y", "max"),
                                      ("0.49", "", "z", "detail.save_s")]
    assert _statistic({"detail": {"save_s": 0.4939}}, "detail.save_s") == 0.4939
    assert _statistic({"detail": {"params": 23175168}}, "detail.params / 1e6") == 23.175168
    assert [v for v, *_ in recorded_figures("0.05<!-- record: x | min -->-0.11<!-- record: x | max -->")] == ["0.05",
                                                                                                          "0.11"]
    assert _as_written("1.04", "", 1.108) == "1.11" and _as_written("+2", "%", 1.0234) == "+2"
    rows = {"x": {"median": 1.108, "rounds": 16}}
    assert stale_figures("1.11<!-- record: x -->, 16<!-- record: x | rounds --> rounds", rows, "t") == []
    assert stale_figures("1.50<!-- record: x -->", rows, "t") == ["t: 1.50 for 'x' (median), the record has 1.11"]
    assert stale_figures("1.11<!-- record: w -->", rows, "t") == ["t: no figure 'w' in the record"]
    assert recorded_figures("marked `<!-- record: FIGURE -->` in the text") == []  # quoted, not a marker
    for malformed in ("1.50 <!-- record: x -->", "0.90x<!-- record: x -->", "1.11<!-- record: -->",
                      "1.11<!-- record: x | mean -->", "see <!-- record: x -->", "1.1`<!-- record: x -->"):
        with pytest.raises(ValueError, match="malformed or detached"):
            recorded_figures(malformed)


TRAIN_PY_TIMEOUT_S = 120  # the script takes about 10 s on 2 cores


def test_readme_fabric_snippet_runs_as_python_train_py(tmp_path):
    """The README says its Fabric snippet runs as `python train.py`, Fabric starting the second process itself: run it
    so, outside torchrun, with a timeout (a launcher that starts no second process leaves rank 0 waiting for it)."""
    fabric_snippets = [s for s in SNIPPETS if s.path == "README.md" and "fabric.launch()" in s.code]
    assert len(fabric_snippets) == 1, fabric_snippets
    (tmp_path / "train.py").write_text(fabric_snippets[0].code)
    env = {k: v for k, v in os.environ.items()
           if k not in {"WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "GROUP_RANK", "TORCHELASTIC_RUN_ID"}}
    env.update(PROCESS_ENV, **forkserver.env())
    proc = subprocess.Popen([forkserver.python(), "train.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TRAIN_PY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the launched rank shares the session; no process is left waiting
        out, _ = proc.communicate()
        pytest.fail(f"`python train.py` did not finish in {TRAIN_PY_TIMEOUT_S} s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-5000:]
    assert (tmp_path / "checkpoints" / "step-10" / "meta.pt").is_file(), sorted(tmp_path.rglob("*"))


# A GPU model named in the docs (H100, A100, L40S, MI300X, RTX 4090): a claim that something ran there.
GPU_MODEL = re.compile(r"\b(?:[AH]100|H200|H20|A10G?|A30|A40|GB?200|B100|L4|L40S?|V100|T4|MI\d{3}X?|RTX ?\d{4})\b")
# A sentence saying that the record holds no GPU run, however a page puts it (the README: "no run is recorded yet";
# support.md: "The record holds no run yet"): each is stale once a run is recorded.
NO_GPU_RUN = re.compile(r"\bno (?:GPU )?runs? (?:\w+ ){0,3}?(?:yet|recorded)\b"
                        r"|\bnot (?:yet )?(?:been )?run on (?:a |any )?GPU", re.IGNORECASE)


def gpu_claims_against(text: str, runs: list[dict], where: str) -> list[str]:
    """What the text says of GPU runs that the record of GPU runs (``docs/gpu_smoke.json``, written by
    ``tests/gpu/smoke.py``) does not hold: a GPU model with no run on it in which every check that ran passed, or the
    sentence that no run is recorded while one is."""
    passed = [run["device"] for run in runs
              if run["checks"] and all(v in {"pass", "not run"} for v in run["checks"].values())]
    wrong = [f"{where}: names {name}, with no passing run on it in docs/gpu_smoke.json"
             for name in sorted(set(GPU_MODEL.findall(text))) if not any(name in device for device in passed)]
    said = NO_GPU_RUN.search(" ".join(text.split()))
    if runs and said:
        wrong.append(f"{where}: says {said.group(0)!r}, and docs/gpu_smoke.json holds {len(runs)} runs")
    return wrong


def test_gpu_sentences_are_the_gpu_record():
    """The docs' GPU sentences say what tests/gpu/smoke.py recorded, with the device and versions, and no more."""
    runs = json.loads((ROOT / "docs" / "gpu_smoke.json").read_text())["runs"]
    wrong = [w for doc in documents() for w in gpu_claims_against(doc.read_text(), runs, doc.name)]
    assert not wrong, wrong
    # The control: a model named without a run, and with a failed run, is caught; with a passing run it is not.
    run = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "checks": {"a": "pass", "b": "not run"}}
    assert gpu_claims_against("passes on one H100", [], "t") == [
        "t: names H100, with no passing run on it in docs/gpu_smoke.json"]
    assert gpu_claims_against("passes on one H100", [dict(run, checks={"a": "fail"})], "t") != []
    assert gpu_claims_against("passes on one H100", [run], "t") == []
    assert gpu_claims_against("no run is\nrecorded yet", [run], "t") != []
    assert gpu_claims_against("The record holds no run yet.", [run], "t") != []  # support.md's words
    assert gpu_claims_against("The record holds no run yet.", [], "t") == []
    assert GPU_MODEL.findall("README.md-L37, bf16, A100 and L40S") == ["A100", "L40S"]


# --- Measured numbers ---------------------------------------------------------------------------------------------
# "Every numerical claim in the README or a note comes from a command anyone can run, and you name that command."
# A figure in the prose (a number with a unit, a ratio, a tolerance in scientific notation) is one of:
# - measured in the run of record: `0.42<!-- record: FIGURE -->` (a row of docs/benchmarks.json, which
#   `bash benchmarks/run.sh` writes; checked above against the record);
# - measured by another command: `7e-6<!-- measured: tests/workers/tp_patterns.py -->`, naming the file that
#   measures it, with the whole command shown as code in the same paragraph, so a reader can run it;
# - a definition: a bound a test or the code holds ("within 1e-5", "under 2 GB", "at most 1.05"), a setting
#   ("every 8 MiB", "s3fs's default part size of 50 MiB"), found by the words right before it, or one of the few
#   entries of DEFINITIONS below, each with its reason.
# Anything else fails: a measured number that names no command is how "173 MB" and "several 1e-6" got in.

SCANNED_FOR_FIGURES = sorted({*ROOT.glob("docs/*.md"), *ROOT.glob("docs/guides/*.md"), *ROOT.glob("docs/reference/*.md"),
                              ROOT / "README.md"} - {ROOT / "docs" / "benchmarks-table.md"})  # generated from the record

UNITS = r"[KMGT]i?B|ms|s|%|x|×|times|seconds?|minutes?|hours?"
# A number not glued to a word, a dot, a path or a formula (`fp32`, `2.13.0`, `16·P/N`, `Qwen2.5`), and not part of a
# version, a date or a list of digits; then an optional unit. Only ratios around 1 (`0.42`, `1.05`) count without a
# unit: a larger decimal without one is a version (torch 2.13, Python 3.11, Llama 3.2) or a model's size (6.5B).
FIGURE = re.compile(rf"(?<![\w.·/^])(?P<number>[-+]?\d+(?:,\d{{3}})*(?:\.\d+)?(?:e[-+]?\d+)?)(?![.,]?\d|e[-+]?\d)"
                    rf"(?P<unit>\s?(?:{UNITS})(?!\w)(?!\s*\d))?")
RATIO = re.compile(r"[-+]?[01]\.\d+")
# Words that make the figure right after them a bound or a setting, not a measurement: within the 25 characters
# before it and the same clause ("within max(1e-6, 10 x", "up to 3 times", "a default part size of 50 MiB").
BOUND = re.compile(r"(?:\b(?:within|under|over|below|above|at most|at least|up to|less than|more than|default|every)"
                   r"\b|<=|>=|≤|≥|[<>])[^.;:!?]{0,25}$", re.IGNORECASE)
# Definitions the words above do not show, each a setting or an input the text describes, not a result.
DEFINITIONS = {
    ("guides/checkpoints.md", "A 2.6 KB file of lists"): "the input tests/workers/tamper.py builds (a DAG of 60 levels)",
    ("guides/huggingface.md", "(1.35 GB in 4 files"): "the checkpoint benchmarks/pretrained_load_memory.py writes with "
                                                       "its default sizes",
    ("benchmarks.md", "134 MB in fp32"): "the model full_state_load_memory.py builds: 8 * 2048 * 2049 * 4 bytes",
    ("reference/cli.md", "of 8 MiB tensors"): "the tensor size of the model benchmarks/convert_memory.py builds",
    ("reference/cli.md", "with 20 MB shards"): "the shard size test_cli.py's conversion sets",
    ("guides/troubleshooting.md", "warning after 5 s"): "process_exit.py's _WARN_AFTER_S",
    ("guides/troubleshooting.md", "cap is 2 s"): "process_exit.py's UNVERIFIED_WAIT_S",
}
MEASURED = re.compile(r"<!--\s*measured:\s*(?P<path>[^\s>]*)\s*-->")
FENCED = re.compile(r"^ *(`{3,}|~{3,}).*?^ *\1[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?!`)(?P<code>.+?)(?<!`)\1(?!`)", re.S)


def _blank(m: re.Match) -> str:
    """The match's text replaced by spaces, keeping its newlines, so positions and line numbers stay."""
    return re.sub(r"[^\n]", " ", m.group(0))


def measured_markers(text: str) -> list[str]:
    """The problems of the text's ``<!-- measured: PATH -->`` markers: each must sit right after a number, name a
    file of the repository, and have a code span naming that file in its paragraph (the command to run)."""
    bad = []
    for m in MEASURED.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        start = text.rfind("\n\n", 0, m.start()) + 1
        end = text.find("\n\n", m.end()) % (len(text) + 1)
        paragraph = MEASURED.sub("", text[start:end])
        commands = [" ".join(c["code"].split()) for c in CODE_SPAN.finditer(paragraph)]
        if not re.search(r"\d$", text[:m.start()]):
            bad.append(f"line {line}: {m.group(0)!r} is not right after a number")
        elif not m["path"] or not (ROOT / m["path"]).is_file():
            bad.append(f"line {line}: {m.group(0)!r} names no file of the repository")
        elif not any(m["path"] in c and " " in c for c in commands):  # a command, not the bare path
            bad.append(f"line {line}: no command naming {m['path']} shown as code in the paragraph")
    return bad


def unmarked_figures(text: str, where: str) -> list[str]:
    """Every figure of ``text`` (a page at ``where``, relative to docs/ or the root) that is neither marked as
    measured nor a definition, as ``where:line: figure in 'context'``."""
    prose = FENCED.sub(_blank, text)
    prose = re.sub(r"<!--\s*(?:record|measured):.*?-->", lambda m: "\0" * len(m.group(0)), prose, flags=re.S)
    prose = re.sub(r"<!--.*?-->", _blank, prose, flags=re.S)
    prose = CODE_SPAN.sub(_blank, prose)  # code is what one types: `eps=1e-8`, `--devices 2`
    prose = re.sub(r"\]\([^)]*\)", _blank, prose)  # link targets
    marked = {m.start() for m in re.finditer("\0+", prose)}  # where each marker starts
    prose = prose.replace("\0", " ")
    found = []
    for m in FIGURE.finditer(prose):
        number, unit = m["number"], m["unit"]
        if not (unit or "e" in number or RATIO.fullmatch(number)):
            continue  # a count or an index: "2 ranks", "step 8"
        if m.end("number") in marked:
            continue  # a marker right after the number
        before = " ".join(prose[max(0, m.start() - 60):m.start()].split())
        if BOUND.search(before):
            continue
        context = " ".join(prose[max(0, m.start() - 40):m.end() + 40].split())
        if any(doc == where and phrase in context and m.group(0).strip() in phrase
               for doc, phrase in DEFINITIONS):
            continue
        line = text.count("\n", 0, m.start()) + 1
        found.append(f"{where}:{line}: {m.group(0).strip()!r} in {context!r}")
    return found


def _where(doc: Path) -> str:
    return str(doc.relative_to(ROOT / "docs")) if doc.is_relative_to(ROOT / "docs") else doc.name


def test_every_figure_in_the_docs_is_measured_with_its_command_or_a_definition():
    """A measured number names its command: the record's marker, or a `measured:` marker whose command the paragraph
    shows. Bounds and settings pass by the words before them, or by DEFINITIONS, whose every entry must still be
    used (a stale one fails)."""
    unmarked, markers = [], []
    for doc in SCANNED_FOR_FIGURES:
        text = doc.read_text()
        unmarked += unmarked_figures(text, _where(doc))
        markers += [f"{_where(doc)}: {bad}" for bad in measured_markers(text)]
    assert not markers, f"malformed `<!-- measured: PATH -->` markers: {markers}"
    assert not unmarked, (
        "figures that are neither marked as measured nor definitions: " + "; ".join(unmarked) + ". HINT: a measured"
        " number names its command: `0.42<!-- record: FIGURE -->` for a row of docs/benchmarks.json, or"
        " `7e-6<!-- measured: PATH -->` with the command running PATH shown as code in the same paragraph; a bound or"
        " a setting says so in words ('within 1e-5', 'at most 1.05', 'a default of 50 MiB') or, if it cannot, gets"
        " an entry with its reason in DEFINITIONS in tests/test_docs.py.")
    texts = {_where(doc): " ".join(doc.read_text().split()) for doc in SCANNED_FOR_FIGURES}
    stale = [key for key in DEFINITIONS if key[1] not in texts.get(key[0], "")]
    assert not stale, f"DEFINITIONS entries whose phrase is no longer in the page (remove them): {stale}"


def test_unmarked_figures_are_found():
    """The control for the rule above: what it must catch, and what it must let through."""
    caught = ["a 173 MB checkpoint", "differ by several 1e-6 there", "a save ran at 0.42 of a plain put",
              "the hook costs 3%", "DDP is 1.48x faster", "it took 12 s", "2.5 times faster", "uses 0.78x the peak",
              "a ratio of 1.05.", "peaks at 1.2 GiB"]
    for sentence in caught:
        assert unmarked_figures(sentence, "t.md"), sentence
    passed = ["a 173<!-- record: x | detail.checkpoint_MB --> MB checkpoint", "matches within 1e-5",
              "at most 1.05", "up to 3 times", "under 2 GB", "every 8 MiB", "batch 2 x 1024", "torch 2.13 to 2.15",
              "Python 3.11", "with `eps=1e-8`", "0.78<!-- record: x -->x the peak", "on 2 ranks, step 8",
              "litgpt 0.5.9", "a default part size of 50 MiB", "<= max(1e-6, 10 x max |ddp - single|)",
              "```\n0.42 MB\n```", "7e-6<!-- measured: tests/test_docs.py --> (`pytest tests/test_docs.py`)"]
    for sentence in passed:
        assert not unmarked_figures(sentence, "t.md"), sentence
    assert unmarked_figures("x\nthe 1.35 GB file", "guides/huggingface.md") == [
        "guides/huggingface.md:2: '1.35 GB' in 'x the 1.35 GB file'"]  # an entry of DEFINITIONS holds for its phrase only
    assert measured_markers("0<!-- measured: tests/test_docs.py --> (run `pytest -s tests/test_docs.py`)") == []
    assert measured_markers("was 0<!-- measured: tests/test_docs.py -->.") == [
        "line 1: no command naming tests/test_docs.py shown as code in the paragraph"]
    assert "names no file" in measured_markers("0<!-- measured: tests/nothing.py --> `tests/nothing.py`")[0]
    assert "not right after a number" in measured_markers("zero <!-- measured: tests/test_docs.py -->")[0]
    assert measured_markers("`tests/test_docs.py` says 0<!-- measured: tests/test_docs.py -->.") == [
        "line 1: no command naming tests/test_docs.py shown as code in the paragraph"]  # the path alone runs nothing


def test_object_storage_guide_says_the_requests_a_save_and_a_load_make(ledger, monkeypatch):
    """The guide's request table is what a sharded save and load of one rank send to S3, counted at the server
    (tests/ledger.py): a shard of two parts is a multipart upload (create, 2 parts, complete), the three small
    objects are one PUT each, the commit one LIST and one conditional PUT; the load reads COMMIT, the three small
    objects by one ranged GET each and the shard by ranged GETs of its items, and never lists or HEADs an object."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from lightning_fsdp.checkpoint.io import store, transfers
    from lightning_fsdp.checkpoint.io.one_process import OneProcess
    from lightning_fsdp.checkpoint.load import load_checkpoint
    from lightning_fsdp.checkpoint.save import save_checkpoint

    for key, value in ledger.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(transfers, "_current", transfers.check_transfers(part_size=5 * 2**20))
    # A store made by an earlier test of this process keeps the endpoint it was made with: this one is the ledger's.
    monkeypatch.setattr(store, "_remote_stores", {})
    url = f"s3://{ledger.bucket()}/run/step-1"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = fully_shard(torch.nn.Linear(1024, 1536, bias=False))  # 6 MiB of weights: two parts of 5 MiB
        ledger.reset()
        save_checkpoint(url, {"model": model}, full=False, comm=OneProcess())
        saved = ledger.records()
        ledger.reset()
        other = fully_shard(torch.nn.Linear(1024, 1536, bias=False))
        load_checkpoint(url, {"model": other}, comm=OneProcess())
        loaded = ledger.records()
        assert torch.equal(other.weight.full_tensor(), model.weight.full_tensor())
    finally:
        dist.destroy_process_group()

    def leaf(r) -> str:
        return r.key.rsplit("/", 1)[-1]

    shard = [r for r in saved if leaf(r) == "__0_0.distcp"]
    part = ("PUT", ("partNumber", "uploadId"))
    assert sorted((r.method, tuple(sorted(r.query))) for r in shard) == sorted(
        [("POST", ("uploads",)), part, part, ("POST", ("uploadId",))]), shard  # create, 2 parts, complete
    small = sorted((r.method, leaf(r)) for r in saved if leaf(r) in (".metadata", "checksums.json", "meta.pt"))
    assert small == [("PUT", ".metadata"), ("PUT", "checksums.json"), ("PUT", "meta.pt")], small
    assert [r.method for r in saved if leaf(r) == "COMMIT" and r.method == "PUT"] == ["PUT"]
    assert not [r for r in loaded if r.method not in ("GET", "HEAD")], loaded
    assert not [r for r in loaded if r.method == "HEAD" and leaf(r) != "COMMIT"], loaded  # sizes come from COMMIT
    assert not [r for r in loaded if r.method == "GET" and leaf(r) in (".metadata", "checksums.json", "meta.pt")
                and r.range is None], loaded
    for name in (".metadata", "checksums.json", "meta.pt"):
        assert len([r for r in loaded if leaf(r) == name]) == 1, (name, loaded)
    ranges = [r for r in loaded if leaf(r) == "__0_0.distcp"]
    assert ranges and all(r.range for r in ranges), ranges
    assert sum(r.bytes_out for r in ranges) <= 1.1 * 1536 * 1024 * 4
    guide = " ".join((ROOT / "docs" / "guides" / "object-storage.md").read_text().split())
    assert "1 create, one PUT per part of `part_size`" in guide
    assert "one ranged GET each of `.metadata`, `checksums.json` and `meta.pt`" in guide
    assert "ranged GETs of the items it needs" in guide and "no LIST, no HEAD of an object" in guide
