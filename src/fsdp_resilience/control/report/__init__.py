"""Run reports: where a run's wall time went (goodput), a Markdown summary and three figures.

Everything is computed from the run dir alone — the events log, ``run.json``, ``eval.json`` and the
checkpoint commit markers — so a report can be built by an Airflow task, by hand on a laptop, or
while the run is still going. The package is torch-free; matplotlib is imported only when figures
are drawn.

- ``records``: reading the events log (defensively) into step executions, save windows, start-up spans
- ``goodput``: the accounting, every second of wall time in one category
- ``markdown``: ``report.md``
- ``figures``: ``loss.png``, ``timeline.png``, ``goodput.png``
- ``build``: ``build_report(run_dir)``, which writes them all

Usage::

    python -m fsdp_resilience.control.report RUN_DIR     # prints the path of RUN_DIR/report/report.md
"""
