"""Deferrable triggers, one module per thing they wait for; ``base`` holds what they share (the
shape of their events, the wait between checks)."""
