"""The launcher starts in milliseconds: none of its modules imports torch; and the guard's command
imports the guard from where it lives."""

from __future__ import annotations

import subprocess
import sys

from fsdp_resilience.training.launch.guard import guard_command

LAUNCH_MODULES = ("cli", "command", "config", "event_tail", "guard", "lock", "node", "outcome", "storage")


def test_no_launcher_module_imports_torch():
    imports = "; ".join(f"import fsdp_resilience.training.launch.{m}" for m in LAUNCH_MODULES)
    code = f"import sys; sys.modules['torch'] = None\n{imports}\nprint('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_the_guard_command_runs_supervise_from_the_guard_module():
    command = guard_command(7, ["ft_launcher", "--x"])
    assert command[:2] == [sys.executable, "-c"]
    assert "from fsdp_resilience.training.launch.guard import supervise" in command[2]
    assert command[3:] == ["7", "ft_launcher", "--x"]
