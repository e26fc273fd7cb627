"""The contract package as a whole: torch-free, every public name exported, and its generated
reference (docs/reference/) up to date with the code."""

import subprocess
import sys


def test_the_contract_and_launcher_never_import_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import fsdp_resilience.training.contract, fsdp_resilience.training.launch\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
