"""Renderers of the result grids: markdown tables, JSON rows and plots from the run files on disk
(never from a process's memory, so any set of finished runs renders the same way)."""
