"""Built-in rules, one per module. A module's PRIORITY orders it (lower runs first)."""
