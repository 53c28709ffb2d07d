"""relax_plugins."""
