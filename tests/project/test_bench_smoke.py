"""The benchmark harness still works: a seconds-long ``python -m bench run --quick``.

Benchmarks are not timed tests. This runs the harness end to end on a few
paths (nginx too when it is installed) and checks that every scenario
produced numbers that make sense, never how fast anything was.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from locations import REPO

sys.path.insert(0, str(REPO))

from bench.paths import nginx_binary

PATHS = ["direct", "sidecar", "fastapi-mw"] + (["nginx"] if nginx_binary() else [])
PROXIES = [p for p in PATHS if p != "direct"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("bench")
    command = [sys.executable, "-m", "bench", "run", "--quick", "--out", str(out)]
    done = subprocess.run(
        [*command, "--paths", ",".join(PATHS)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    [result] = out.glob("*.json")
    return json.loads(result.read_text()), out


def _sane(p: dict[str, Any]) -> None:
    assert p["n"] > 0
    assert 0 < p["p50"] <= p["p99"] <= p["max"]
    assert p["max"] < 10_000  # milliseconds: no event took ten seconds


def test_quick_run_measures_every_requested_path(run: tuple[dict[str, Any], Path]) -> None:
    doc, _ = run
    assert doc["unavailable"] == {}
    assert set(doc["paths"]) == set(PATHS)
    assert doc["command"].startswith("python -m bench run --quick")


def test_event_latencies_are_sane_and_every_event_arrives(
    run: tuple[dict[str, Any], Path],
) -> None:
    results = run[0]["results"]
    single = results["a_single_stream"]["per_path"]
    [level] = results["b_concurrency"]["levels"]
    for name in PATHS:
        for entry in (single[name], level["per_path"][name]):
            _sane(entry["latency_ms"])
            assert entry["failures"] == 0
            # Every stream opened and events flowed in every window; how many
            # per second is the benchmark's finding, not the harness's health.
            for window in entry["windows"]:
                assert window["opened"] == window["streams"], window
                assert window["delivered_events_per_s"] > 0, window
        assert level["per_path"][name]["added_ms"]["p50"] is not None
    assert level["per_path"]["direct"]["proxy_cpu_us_per_event"] is None
    for name in PROXIES:
        assert level["per_path"][name]["proxy_cpu_us_per_event"] > 0


def test_cancel_ttft_and_idle_memory_are_measured(run: tuple[dict[str, Any], Path]) -> None:
    results = run[0]["results"]
    cancel = results["e_cancel"]["per_path"]
    for name in PATHS:
        # Every path here closes a silent upstream when its client leaves.
        assert cancel[name]["missing"] == 0
        _sane(cancel[name]["ms"])
        ttft = results["f_ttft"]["per_path"][name]
        _sane(ttft["streamed_ms"])
        _sane(ttft["whole_ms"])
    idle = results["d_idle_memory"]["per_path"]
    for name in PROXIES:
        assert idle[name]["opened"] == idle[name]["requested"]
        assert idle[name]["kib_per_stream"] is not None


def test_targets_table_and_plot_are_written(run: tuple[dict[str, Any], Path]) -> None:
    doc, out = run
    assert {t["path"] for t in doc["targets"]} == {"sidecar", "sidecar-uvloop"}
    text = (out / "latest.md").read_text()
    for heading in ("## Targets", "## (a)", "## (b)", "## (d)", "## (e)", "## (f)"):
        assert heading in text
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "latest.png").stat().st_size > 10_000


def test_filters_cost_runs_and_the_stream_comes_out_unchanged() -> None:
    command = [sys.executable, "-m", "bench", "filters-cost", "--rounds", "2"]
    command += ["--streams", "2", "--events", "40", "--tps", "400"]
    done = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=180, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("JSON "))
    result = json.loads(line[5:])
    for pattern in result["cpu"].values():
        assert pattern["plain_us_per_event_best"] > 0 and pattern["ratio_median"] > 0
    assert result["hold"]["events"] > 0
