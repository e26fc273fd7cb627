"""docs/benchmarks.md, section 5: the evaluation load of a checkpoint."""

from __future__ import annotations

from typing import Any

from bench.summarize.formats import fmt_stat, md_table


def evaluation_section(tp: dict[str, Any]) -> list[str]:
    """### 5. Evaluation load: load_model against raw reads of the same bytes."""
    lines: list[str] = []
    evaluation = tp.get("eval_load")
    if evaluation:
        s = evaluation["seconds"]
        lines += ["### 5. Evaluation load", ""]
        lines += [
            f"`fsdp_resilience.training.evaluate.load_model` of a `{evaluation['model']}` checkpoint saved by "
            f"{evaluation['saved_world_size']} "
            f"ranks, {evaluation['file_mb']:.0f} MB of files of which {evaluation['model_mb']:.0f} MB are the model "
            f"(the rest is optimizer state, which evaluation skips), into one process, {evaluation['trials']} "
            f"trials. Page cache: {evaluation['page_cache']}. Raw read: "
            f"{evaluation.get('raw_read', 'reads into a buffer')}.",
            "",
        ]
        lines += md_table(
            ("", "seconds", "load ÷ this"),
            [
                (
                    f"load into the evaluation process (verified by {evaluation.get('verified_by', 'file checksums')}: "
                    f"{evaluation.get('verification', 'sizes and CRC32C of every file, then DCP load')})",
                    fmt_stat(s["load_model"]),
                    "1×",
                ),
                (
                    f"  of which building the model ({evaluation.get('build', 'random init')})",
                    fmt_stat(s["build_model_only"]),
                    "",
                ),
                (
                    "raw read of the model tensors' bytes (what the load reads) into a reused buffer",
                    fmt_stat(s["raw_read_model_bytes"]),
                    f"{evaluation['ratios']['load_over_raw_read_model_bytes']}×",
                ),
            ]
            + (
                [
                    (
                        "the same into memory allocated for each read (as a new model's parameters are: page faults)",
                        fmt_stat(s["raw_read_model_bytes_fresh_memory"]),
                        f"{evaluation['ratios']['load_over_raw_read_model_bytes_fresh_memory']}×",
                    )
                ]
                if "raw_read_model_bytes_fresh_memory" in s
                else []
            )
            + [
                (
                    "raw read of all the checkpoint's files",
                    fmt_stat(s["raw_read_files"]),
                    f"{evaluation['ratios']['load_over_raw_read_files']}×",
                )
            ]
            + (
                [
                    (
                        f"for comparison, what a resume's full verification costs: sizes + CRC32C of all the files "
                        f"({evaluation['ratios']['verify_gib_per_s']} GiB/s)",
                        fmt_stat(s["verify_checksums"]),
                        f"{round(1 / evaluation['ratios']['verify_over_load'], 2)}×",
                    )
                ]
                if "verify_checksums" in s
                else []
            ),
        )
    return lines
