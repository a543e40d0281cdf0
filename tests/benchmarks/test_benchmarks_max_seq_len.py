"""Smoke test of benchmarks/max_seq_len.py in a tiny configuration: the longest sequence of every
strategy under one emulated device budget, checked against each other (never against fixed figures).

Its own file (beside tests/benchmarks/test_benchmarks_smoke.py, whose helpers it uses) because it is
the longest benchmark smoke test: `make test`'s two workers take one file each at a time, and a
long file beside others makes the whole run wait for one worker.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.benchmarks.test_benchmarks_smoke import ALL_ROWS, PEERS, _run


def test_max_seq_len_orders_strategies(tmp_path: Path) -> None:
    out = tmp_path / "max_seq_len.json"
    # The search starts at 2K and stops at 2,560 (granularity 512): none and full-offload bisect down to
    # 512, full recompute and offloaded-checkpoint stop at 2,048 (2,560 fails), memo, torchtune-offload
    # and save-on-cpu reach 2,560; 2 or 3 tries each instead of up to 6 (the 512, 1K and 4K tries told
    # nothing more, and a 3K try, the costliest, told nothing the asserts below use once the two peers
    # joined the run). Two searches at once: each strategy's interpreter emulates its own device.
    done = _run("max_seq_len.py", "--model", "tiny", "--device", "cpu", "--device-mem-mb", "24",
                "--start", "2K", "--granularity", "512", "--max-seq", "2560", "--time-limit", "1",
                "--jobs", "2", "--json", str(out), timeout=300)
    report = json.loads(out.read_text())
    assert report["kind"] == "memo.benchmark.max_seq_len"
    longest = {r["strategy"]: r["longest"] for r in report["results"]}
    assert set(longest) == set(ALL_ROWS)
    assert 0 < longest["none"] <= longest["full-recompute"], longest
    assert longest["none"] <= longest["save-on-cpu"], longest
    # The peers that checkpoint every layer train at least what full recompute does... minus what the
    # fallback pool's segments waste (one 512-token step here: offloaded-checkpoint's 2,560 fails on a
    # 6 MiB segment with 10 MiB allocated of 18 MiB reserved).
    for peer in ("offloaded-checkpoint", "torchtune-offload"):
        assert longest[peer] >= longest["full-recompute"] - 512 and longest[peer] > longest["none"], longest
    assert report["best_peer"] in PEERS
    assert max(longest[p] for p in PEERS) == longest[report["best_peer"]], (report["best_peer"], longest)
    assert f"BP: {report['best_peer']}, the longest of" in done.stdout and "vs BP" in done.stdout
    # memo trains longer sequences than keeping every activation, than offloading all of them, and
    # than full recompute (24 MiB, two steps per try: none and full-offload 512, full recompute 2,048,
    # memo 2,560; before the headroom was at least one fallback segment, NOTE [Fallback headroom],
    # memo's plans "fit" and then failed in step 2 on segment rounding, at 1,024).
    assert longest["memo"] > longest["none"] and longest["memo"] > longest["full-offload"], longest
    assert longest["memo"] >= longest["full-recompute"], longest
    for r in report["results"]:
        # The search is consistent: the longest length fit, and the first failure did not.
        fits = {t["seq_len"]: t["fits"] for t in r["tries"]}
        if r["longest"]:
            assert fits[r["longest"]] is True, r
        if r["first_failure"] is not None:
            assert fits[r["first_failure"]] is False and r["first_failure"] > r["longest"], r
            assert any("out of memory" in t["detail"] for t in r["tries"] if not t["fits"]), r
    assert "vs FR" in done.stdout
    for r in report["results"]:  # the device peak, host bytes and step time at the longest length
        at = r["at_longest"]
        if r["longest"]:
            assert at["peak_device_bytes"] > 0 and at["step_time_s"] > 0, r
            if r["strategy"] in PEERS or r["strategy"] in ("none", "full-recompute"):
                assert (at["host_bytes"] > 0) == (r["strategy"] in PEERS), r
