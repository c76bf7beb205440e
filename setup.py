"""The package list, found rather than written down: a new package under ckptio/ or benchmarks/ cannot be
left out of the wheel (0.2's hand-written list missed ckptio.tiers, and the wheel did not import).
Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

BENCH_SOURCE, BENCH_PACKAGE = "benchmarks", "ckptio.bench"

bench_sources = find_packages(include=[BENCH_SOURCE, BENCH_SOURCE + ".*"])
setup(
    packages=[
        *find_packages(include=["ckptio", "ckptio.*"]),
        *(BENCH_PACKAGE + p[len(BENCH_SOURCE) :] for p in bench_sources),
    ]
)
