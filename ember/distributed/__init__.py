"""Running one model over several processes: the shared-memory broadcast of each step's plan."""
