"""`offpolicy quickstart`: the whole pipeline on this machine (`run.py`), its run settings, what it shows."""
