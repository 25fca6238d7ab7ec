"""The local orchestrator: worker processes on one machine, driven by scale decisions."""
