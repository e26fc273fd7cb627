"""The benchmark summary: ``python -m bench.summarize`` merges the parts' results into
``bench/results/latest.json``, draws the plots, and writes docs/benchmarks.md and the README's block.

- ``results``: merging the parts' JSON into one summary
- ``formats``: how figures, statistics and tables are written
- ``targets``: the issue's targets, measured and met or missed
- ``benchmarks_md``: docs/benchmarks.md, a pure function of the summary
- ``sections``: its numbered sections, a module each (stall, recovery, chaos, control_plane, evaluation)
- ``readme``: the README's short block of headline figures
- ``plots``: stall, recovery and Young/Daly plots (matplotlib)
"""
