"""A few seconds of coverage-guided fuzzing of the SSE decoder and framer (atheris).

The fuzz target lives in ``fuzz/fuzz_sse.py``; run it for longer by hand:
``python fuzz/fuzz_sse.py -max_total_time=600``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from locations import REPO, STREAMS

SECONDS = 8


def test_fuzzing_the_decoder_finds_nothing(tmp_path: Path) -> None:
    pytest.importorskip("atheris", reason="atheris is not installed (pip install atheris)")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for seed in STREAMS.iterdir():
        if seed.suffix in (".sse", ".txt", ".ndjson"):
            shutil.copy(seed, corpus / seed.name)
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "fuzz" / "fuzz_sse.py"),
            str(corpus),
            f"-max_total_time={SECONDS}",
            "-print_final_stats=1",
            "-max_len=8192",
        ],
        capture_output=True,
        text=True,
        timeout=SECONDS + 60,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = re.search(r"stat::number_of_executed_units:\s+(\d+)", result.stderr)
    assert runs is not None and int(runs.group(1)) > 1000
    print(f"fuzz executions: {runs.group(1)}")
