"""Evidence a user can run: `paralm verify` (every exact layout equals one process) and `paralm compare`."""
