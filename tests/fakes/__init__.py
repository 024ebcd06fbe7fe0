"""Stand-ins for packages that cannot run on this CPU-only machine (see each module)."""
