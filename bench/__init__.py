"""The benchmarks behind `rlpipe bench`, reported as ratios against a baseline measured in the same run (these
machines are noisy): tooling on top of the library, which loads it only from cli.py."""
