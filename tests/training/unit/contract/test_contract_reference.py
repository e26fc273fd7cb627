"""The contract package as a whole: torch-free, every public name exported, and its generated
reference (docs/reference/) up to date with the code."""

import ast
import dataclasses
import importlib
import subprocess
import sys
from pathlib import Path

from fsdp_resilience.training.contract import config, reference


def test_the_contract_and_launcher_never_import_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import fsdp_resilience.training.contract, fsdp_resilience.training.launch\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_the_package_exports_every_public_name_of_its_modules():
    """``from fsdp_resilience.training.contract import X`` works for whatever its modules define
    (the per-kind event TypedDicts live in ``events`` only)."""
    import fsdp_resilience.training.contract as contract

    assert all(hasattr(contract, name) for name in contract.__all__)
    event_types = {cls.__name__ for cls in contract.EVENT_TYPES.values()}
    for module in (
        "failures",
        "config",
        "timeouts",
        "rundir",
        "checkpoints",
        "checkpoint_catalog",
        "dataset",
        "events",
        "files",
        "version",
        "model_sizes",
    ):
        tree = ast.parse(Path(importlib.import_module(f"{contract.__name__}.{module}").__file__).read_text())
        defined = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
        defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        missing = {n for n in defined if not n.startswith("_")} - set(contract.__all__) - event_types
        assert not missing, f"{module}: {sorted(missing)} not exported by the package"


def test_every_run_config_field_has_a_docstring():
    for cls in ("RunConfig", "FaultDrill"):
        fields = reference.field_docs(config, cls)
        assert [f["name"] for f in fields] == [f.name for f in dataclasses.fields(getattr(config, cls))]
        assert all(f["doc"] for f in fields), [f["name"] for f in fields if not f["doc"]]


def test_the_generated_reference_is_up_to_date():
    """docs/reference/ is written by the generator; regenerate it after changing the contract:
    ``python -m fsdp_resilience.training.contract.reference``."""
    out = subprocess.run(
        [sys.executable, "-m", "fsdp_resilience.training.contract.reference", "--check"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr


def test_the_check_names_a_stale_or_missing_page(tmp_path):
    assert reference.main(["--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["README.md", *reference.PAGES])
    assert len(reference.PAGES) == 7
    assert reference.main(["--check", "--out", str(tmp_path)]) == 0
    (tmp_path / "events.md").write_text("edited by hand\n")
    (tmp_path / "run-dir.md").unlink()
    assert reference.main(["--check", "--out", str(tmp_path)]) == 1
