"""Operators: the control plane's tasks that act (an FSx data repository task, the spare pool keeper)."""
