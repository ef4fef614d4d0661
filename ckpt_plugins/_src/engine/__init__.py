"""Execution: `write` (snapshot and write a save), `read` (a load's reads and exchanges), `ring`."""
