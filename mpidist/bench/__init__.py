"""Benchmarks: `mpidist bench NAME` runs `mpidist.bench.NAME.main(argv)`.

See docs/BENCHMARKS.md.
"""
