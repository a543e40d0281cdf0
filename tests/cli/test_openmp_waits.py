"""NOTE [OpenMP threads that sleep] in memo/cli/main.py: a `memo` command waits passively at OpenMP
barriers unless the environment already chose."""

from __future__ import annotations

import os

import pytest

from memo.cli.main import _openmp_threads_sleep


@pytest.mark.parametrize("given, expected", [
    ({}, {"OMP_WAIT_POLICY": "PASSIVE"}),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "ACTIVE"}),
    ({"GOMP_SPINCOUNT": "300000"}, {"GOMP_SPINCOUNT": "300000"}),
])
def test_waits_passive_unless_chosen(monkeypatch, given, expected):
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    _openmp_threads_sleep()
    assert {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ} == expected
