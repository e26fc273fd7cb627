"""The numbered sections of docs/benchmarks.md, a module each; ``benchmarks_md`` puts them together."""
